"""`profiler_svc demo --no-serve`: the README's main job prepares its own database from the bundled
GPU traces plus a live capture on this machine."""
from pathlib import Path

import pytest

from profiler_svc.cli import main
from profiler_svc.storage import db as storage_db
from profiler_svc.service.demo import SAMPLES, WORKLOAD, demo_config


def test_demo_ingests_samples_and_a_live_capture(capsys):
    pytest.importorskip("torch")
    assert main(["demo", "--no-serve"]) == 0
    out = capsys.readouterr().out
    samples = sorted(p for p in SAMPLES.iterdir() if p.is_dir() or p.name.endswith(".json.gz"))
    assert len(samples) >= 6 and all(f"sample {p.name}: run" in out for p in samples)
    assert "live capture" in out and "sign in (for the A/B button) with the token: " in out

    config = demo_config()
    from profiler_svc.web import create_app
    client = create_app({"DATABASE_URL": config["DATABASE_URL"], "BLOB_DIR": config["BLOB_DIR"],
                         "SECRET_KEY": "s", "PUBLIC_READ": True}).test_client()
    runs = client.get("/api/v1/runs").get_json()["runs"]
    ddp = [r for r in runs if r["name"] == "gpt2_ddp"]
    assert len(ddp) == 1 and ddp[0]["traces"] == 2  # the two ranks are one run
    assert len(runs) == len(samples) + 1  # a run per sample (the DDP folder's ranks are one) + the live capture
    live = [r for r in runs if r["workload"] == WORKLOAD]
    assert len(live) == 1
    llama = next(r for r in runs if r["name"] == "llama_bf16_train")
    page = client.get(f"/api/v1/runs/{llama['id']}").get_json()
    assert page["findings"] and page["summary"]["gpu_busy_pct"] > 0

    # The live capture is a CPU trace: its page says why it has no kernels.
    live_page = client.get(f"/runs/{live[0]['id']}").get_data(as_text=True)
    assert 'id="no-kernels"' in live_page and "without a GPU" in live_page

    # Running it again stores nothing twice: the samples are kept, the live capture replaced.
    assert main(["demo", "--no-serve"]) == 0
    out = capsys.readouterr().out
    assert out.count("(already stored)") == len(samples) and "replaces the previous one" in out
    again = client.get("/api/v1/runs").get_json()["runs"]
    assert len(again) == len(runs) and len([r for r in again if r["workload"] == WORKLOAD]) == 1
    assert sum(1 for p in Path(config["BLOB_DIR"]).rglob("*") if p.is_file()) == sum(r["traces"] for r in again)
    storage_db._engines.pop(config["DATABASE_URL"]).dispose()
