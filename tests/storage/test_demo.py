"""`profiler_svc demo --no-serve`: the README's main job prepares its own database from the bundled
GPU traces plus a live capture on this machine."""
import html
import json
import re
from pathlib import Path

import pytest

from profiler_svc.cli import main
from profiler_svc.storage import db as storage_db
from profiler_svc.service import demo
from profiler_svc.service.demo import AB_SAMPLES, WORKLOAD, demo_config, sample_traces


def test_demo_ingests_samples_and_a_live_capture(capsys):
    pytest.importorskip("torch")
    assert main(["demo", "--no-serve"]) == 0
    out = capsys.readouterr().out
    samples = sample_traces()
    ab_samples = sorted(AB_SAMPLES.glob("*.json"))  # bundled A/B results: a run of jobs each, no traces
    assert len(samples) >= 6 and all(f"sample {p.name}: run" in out for p in samples)
    assert "live capture" in out and "sign in (for the A/B button) with the token: " in out

    config = demo_config()
    from profiler_svc.web import create_app
    client = create_app({"DATABASE_URL": config["DATABASE_URL"], "BLOB_DIR": config["BLOB_DIR"],
                         "SECRET_KEY": "s", "PUBLIC_READ": True}).test_client()
    runs = client.get("/api/v1/runs").get_json()["runs"]
    ddp = [r for r in runs if r["name"] == "gpt2_ddp"]
    assert len(ddp) == 1 and ddp[0]["traces"] == 2  # the two ranks are one run
    # a run per sample (the DDP folder's ranks are one) + the live capture
    assert len(runs) == len(samples) + len(ab_samples) + 1
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
    assert out.count("(already stored)") == len(samples) + len(ab_samples) and "replaces the previous one" in out
    again = client.get("/api/v1/runs").get_json()["runs"]
    assert len(again) == len(runs) and len([r for r in again if r["workload"] == WORKLOAD]) == 1
    assert sum(1 for p in Path(config["BLOB_DIR"]).rglob("*") if p.is_file()) == sum(r["traces"] for r in again)
    storage_db._engines.pop(config["DATABASE_URL"]).dispose()


@pytest.fixture(scope="module")
def cpu_ab_result() -> dict:
    """A real ABResult.to_dict(): tiny_llama's rms_norm swap on this machine's CPU (Triton's interpreter)."""
    pytest.importorskip("torch")
    from profiler_svc.ab import ab_test
    model, inputs = demo.tiny_llama()
    return ab_test(model, inputs, ["rms_norm"], rounds=2, warmup=0).to_dict()


def text_of(page: str) -> str:
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", page)))


def test_demo_stores_bundled_ab_results_once(tmp_path, monkeypatch, cpu_ab_result):
    # a test input in a tmp folder: the environment labels are the test's, not a measurement
    folder = tmp_path / "ab_results"
    folder.mkdir()
    env = {"gpu": "TEST-GPU (test input)", "torch": "9.9.9-test", "triton": "8.8.8-test", "cuda": "7.7"}
    sample = {"environment": env, "command": "python benchmarks/fixes_ab.py --out /tmp/test",
              "results": [{"case": "rms_norm tiny_llama fp32 2x64", "result": cpu_ab_result},
                          {"case": "rms_norm tiny_llama fp32 2x64 again", "result": cpu_ab_result}]}
    (folder / "test_gpu.json").write_text(json.dumps(sample))
    monkeypatch.setattr(demo, "AB_SAMPLES", folder)
    lines: list[str] = []
    for _ in range(2):
        app = demo.prepare_demo(print_fn=lines.append, live=False)
    stored = [line for line in lines if line.startswith("sample A/B results test_gpu.json: run ")]
    assert len(stored) == 2 and stored[0].endswith(", 2 job(s)") and stored[1].endswith(", 2 job(s) (already stored)")
    client = app.test_client()
    jobs = client.get("/api/v1/jobs").get_json()["jobs"]
    assert len(jobs) == 2 and {j["status"] for j in jobs} == {"done"}
    assert {j["workload"] for j in jobs} == {r["case"] for r in sample["results"]}

    # the job page says it is a bundled sample, where and with what it was measured, and by which command
    page = text_of(client.get(f"/jobs/{jobs[0]['id']}").get_data(as_text=True))
    assert ("Bundled sample, not a run of yours: measured on TEST-GPU (test input) with torch 9.9.9-test, "
            "triton 8.8.8-test, cuda 7.7 by python benchmarks/fixes_ab.py --out /tmp/test") in page
    assert "Run from the command line" not in page
    run_page = client.get(f"/runs/{jobs[0]['run_id']}").get_data(as_text=True)
    assert 'id="no-traces"' in run_page and 'id="no-kernels"' not in run_page

    # a changed file replaces its jobs, it does not add to them
    sample["results"] = sample["results"][:1]
    (folder / "test_gpu.json").write_text(json.dumps(sample))
    demo.prepare_demo(print_fn=lines.append, live=False)
    assert lines[-1].endswith("1 job(s) (replaces the previous ones)")
    assert len(client.get("/api/v1/jobs").get_json()["jobs"]) == 1
    storage_db._engines.pop(demo_config()["DATABASE_URL"]).dispose()


@pytest.mark.parametrize("content, reason", [
    ("{not json", "not readable JSON"),
    (json.dumps([]), "not an object with environment, command and results"),
    (json.dumps({"environment": {"torch": "2"}, "command": "x", "results": []}), "environment.gpu"),
    (json.dumps({"environment": {"gpu": "G"}, "results": []}), "command"),
    (json.dumps({"environment": {"gpu": "G"}, "command": "x", "results": [{"case": "c", "result": {"a": 1}}]}),
     "results[0].result is not an ABResult.to_dict()"),
])
def test_a_malformed_ab_results_file_is_skipped_in_one_line(tmp_path, monkeypatch, cpu_ab_result, content, reason):
    folder = tmp_path / "ab_results"
    folder.mkdir()
    (folder / "a_bad.json").write_text(content)
    good = {"environment": {"gpu": "TEST-GPU"}, "command": "c", "results": [{"case": "c", "result": cpu_ab_result}]}
    (folder / "b_good.json").write_text(json.dumps(good))
    monkeypatch.setattr(demo, "AB_SAMPLES", folder)
    lines: list[str] = []
    app = demo.prepare_demo(print_fn=lines.append, live=False)
    [bad] = [line for line in lines if "a_bad.json" in line]
    assert bad.startswith("sample A/B results a_bad.json: skipped, ") and reason in bad and "\n" not in bad
    assert any(line.startswith("sample A/B results b_good.json: run ") for line in lines)  # the demo went on
    assert len(app.test_client().get("/api/v1/jobs").get_json()["jobs"]) == 1
    storage_db._engines.pop(demo_config()["DATABASE_URL"]).dispose()


def test_no_ab_results_folder_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "AB_SAMPLES", tmp_path / "absent")
    lines: list[str] = []
    app = demo.prepare_demo(print_fn=lines.append, live=False)
    assert not [line for line in lines if "A/B results" in line]
    assert app.test_client().get("/api/v1/jobs").get_json()["jobs"] == []
    storage_db._engines.pop(demo_config()["DATABASE_URL"]).dispose()
