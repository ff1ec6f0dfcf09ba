"""`profiler_svc demo`: bundled GPU traces plus a live CPU capture, in a SQLite file of its own.

The bundled traces (``profiler_svc/samples``) were captured on an H200 (see the manifest there);
bundled A/B results (``samples/ab_results/*.json``, from the benchmarks on a GPU) become done A/B
jobs that say where they were measured; the live capture profiles `tiny_llama` on this machine. ``tiny_llama`` is also the run's
workload, so the dashboard's "A/B test this swap" works on this machine (on CPU through
Triton's interpreter when there is no GPU).
"""
import hashlib
import json
import os
import secrets
import threading
from pathlib import Path

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
AB_FOLDER = "ab_results"  # in samples: bundled A/B results, not a folder of traces
AB_SAMPLES = SAMPLES / AB_FOLDER
WORKLOAD = "profiler_svc.service.demo:tiny_llama"
LIVE_GROUP = "demo:live-capture"


def tiny_llama():
    """A small Llama-style model written the eager way (RMSNorm in Python, SiLU * up): the kind of
    code whose unfused chains the analyser finds. Returns (model, inputs)."""
    import torch
    from torch import nn

    class RMSNorm(nn.Module):
        def __init__(self, dim, eps=1e-6):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(dim))
            self.eps = eps

        def forward(self, x):
            variance = x.float().pow(2).mean(-1, keepdim=True)
            return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)

    class Block(nn.Module):
        def __init__(self, dim, hidden):
            super().__init__()
            self.norm = RMSNorm(dim)
            self.gate = nn.Linear(dim, hidden, bias=False)
            self.up = nn.Linear(dim, hidden, bias=False)
            self.down = nn.Linear(hidden, dim, bias=False)

        def forward(self, x):
            h = self.norm(x)
            return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))

    class TinyLlama(nn.Module):
        def __init__(self, vocab=512, dim=128, hidden=344, layers=2):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
            self.norm = RMSNorm(dim)
            self.lm_head = nn.Linear(dim, vocab, bias=False)

        def forward(self, tokens):
            x = self.embed(tokens)
            for layer in self.layers:
                x = layer(x)
            return self.lm_head(self.norm(x))

    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = TinyLlama().to(device).eval()
    tokens = torch.randint(0, 512, (2, 64), device=device)
    return model, (tokens,)


def demo_config() -> dict:
    """The demo's own database and blob folder, under $PROFILER_SVC_HOME/demo."""
    from ..storage.db import home
    folder = home() / "demo"
    folder.mkdir(parents=True, exist_ok=True)
    return {"DATABASE_URL": f"sqlite:///{folder / 'demo.sqlite3'}", "BLOB_DIR": str(folder / "blobs"),
            "folder": folder}


def live_capture(folder: Path) -> Path:
    """Profile a few inference steps of tiny_llama on this machine; returns the trace path."""
    import torch
    from ..agent import capture
    model, inputs = tiny_llama()
    out = folder / "live" / "tiny_llama_live.json.gz"
    out.unlink(missing_ok=True)
    with torch.no_grad(), capture(model, out=out, wait=1, warmup=1, active=2, upload=False,
                                  workload=WORKLOAD, name="tiny_llama (live capture)") as cap:
        for _ in range(4):
            model(*inputs)
            cap.step()
    return Path(cap.trace_paths[-1]) if cap.trace_paths else out


def prepare_demo(print_fn=print, live: bool = True):
    """Ingest the samples (ranks of one job grouped), store the sample A/B results and a live capture;
    returns the Flask app."""
    from ..web import create_app
    from ..storage.blobs import BlobStore
    from ..storage.db import get_engine, upgrade
    from ..storage.ingest import ingest_path
    from ..workload_spec import ALLOWED_ENV

    # The demo's own workload is the one this service may run.
    allowed = os.environ.get(ALLOWED_ENV, "")
    if WORKLOAD not in allowed:
        os.environ[ALLOWED_ENV] = f"{allowed},{WORKLOAD}".strip(",")
    config = demo_config()
    engine = get_engine(config["DATABASE_URL"])
    upgrade(engine)
    blobs = BlobStore(config["BLOB_DIR"])
    for path in sample_traces():
        name = path.name.removesuffix(".json.gz")
        results = ingest_path(engine, path, blobs=blobs, name=name, group_key=f"sample:{name}",
                              host="H200 (bundled sample)")
        stored = "already stored" if all(r.duplicate for r in results) else f"{len(results)} trace(s)"
        print_fn(f"sample {path.name}: run {results[0].run_id} ({stored})")
    for path in sorted(AB_SAMPLES.glob("*.json")):
        try:
            sample = read_ab_sample(path)
        except ValueError as err:  # one bad file costs its own jobs, not the demo
            print_fn(f"sample A/B results {path.name}: skipped, {err}")
            continue
        print_fn(store_ab_sample(engine, blobs, path, sample))
    if live:
        trace = live_capture(config["folder"])
        replaced = _drop_run(engine, blobs, LIVE_GROUP)  # one live capture, the newest: `demo` twice adds nothing
        [result] = ingest_path(engine, trace, blobs=blobs, name="tiny_llama (live capture)", workload=WORKLOAD,
                               group_key=LIVE_GROUP)
        print_fn(f"live capture {trace.name}: run {result.run_id}" + (" (replaces the previous one)" if replaced else ""))
    # A local try-out: reads are open; the A/B form needs a signed-in session, so say which token signs in.
    token = os.environ.get("PROFILER_SVC_TOKEN") or secrets.token_urlsafe(16)
    if live:
        print_fn(f"sign in (for the A/B button) with the token: {token}")
    return create_app({"DATABASE_URL": config["DATABASE_URL"], "BLOB_DIR": config["BLOB_DIR"],
                       "API_TOKEN": token, "PUBLIC_READ": True})


def sample_traces() -> list[Path]:
    """The bundled traces: a trace file, or a folder of one job's per-rank traces (one run)."""
    return sorted(p for p in SAMPLES.iterdir()
                  if (p.is_dir() and p.name != AB_FOLDER) or p.name.endswith(".json.gz"))


def read_ab_sample(path: Path) -> dict:
    """A bundled A/B results file: {"environment": {"gpu", "torch", ...}, "command", "results": [{"case",
    "result": ABResult.to_dict()}]}. ValueError, in one line, when it is not that."""
    try:
        sample = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"not readable JSON ({err})") from None
    if not isinstance(sample, dict):
        raise ValueError("not an object with environment, command and results")
    env, command, results = sample.get("environment"), sample.get("command"), sample.get("results")
    if not isinstance(env, dict) or not isinstance(env.get("gpu"), str) or not env["gpu"].strip():
        raise ValueError("environment.gpu (the GPU it was measured on) is missing")
    if not all(isinstance(v, (str, int, float)) for v in env.values()):
        raise ValueError("environment values must be strings or numbers (versions)")
    if not isinstance(command, str) or not command.strip():
        raise ValueError("command (what produced the results) is missing")
    if not isinstance(results, list) or not results:
        raise ValueError("results is not a non-empty list")
    for i, item in enumerate(results):
        result = item.get("result") if isinstance(item, dict) else None
        if not isinstance(item, dict) or not isinstance(item.get("case"), str) or not isinstance(result, dict):
            raise ValueError(f"results[{i}] is not {{\"case\": label, \"result\": ABResult.to_dict()}}")
        # what the job page reads of a result
        if not (isinstance(result.get("verdict"), str) and isinstance(result.get("device"), str)
                and isinstance(result.get("swaps"), list) and isinstance(result.get("parity_passed"), bool)):
            raise ValueError(f"results[{i}].result is not an ABResult.to_dict() (verdict, device, swaps, parity_passed)")
    return sample


def store_ab_sample(engine, blobs, path: Path, sample: dict) -> str:
    """Store a bundled A/B results file as done A/B jobs of a run of its own (no traces, no workload to
    re-run); the same file twice is stored once, a changed one replaces its jobs. Returns a line to print."""
    from sqlalchemy import select
    from ..storage import save_ab_result
    from ..storage.db import session_scope
    from ..storage.models import Run

    group_key, digest = f"sample-ab:{path.stem}", hashlib.sha256(path.read_bytes()).hexdigest()
    env = sample["environment"]
    with session_scope(engine) as session:
        run = session.scalars(select(Run).where(Run.group_key == group_key)).first()
        # the job count too: a run whose storing stopped half-way is stored again
        if run is not None and run.meta.get("sha256") == digest and len(run.jobs) == len(sample["results"]):
            return f"sample A/B results {path.name}: run {run.id}, {len(run.jobs)} job(s) (already stored)"
    replaced = _drop_run(engine, blobs, group_key)
    with session_scope(engine) as session:
        run = Run(name=f"A/B results (bundled sample): {path.stem}", group_key=group_key,
                  host=f"{env['gpu']} (bundled sample)"[:255], workload=None,
                  meta={"source": "bundled sample", "file": path.name, "sha256": digest,
                        "environment": env, "command": sample["command"]})
        session.add(run)
        session.flush()
        run_id = run.id
    provenance = {"file": path.name, "gpu": env["gpu"], "command": sample["command"],
                  "versions": {k: v for k, v in env.items() if k != "gpu"}}
    for item in sample["results"]:
        # the case label stands for the workload: the benchmark's model, dtype and tokens
        save_ab_result(item["result"], workload=item["case"], run_id=run_id, engine=engine, source="sample",
                       params={"sample": {**provenance, "case": item["case"]}}, worker=f"{env['gpu']} (bundled sample)")
    return (f"sample A/B results {path.name}: run {run_id}, {len(sample['results'])} job(s)"
            + (" (replaces the previous ones)" if replaced else ""))


def _drop_run(engine, blobs, group_key: str) -> bool:
    """Delete the run of this group key with its traces' files; whether there was one."""
    from sqlalchemy import select
    from ..storage.db import session_scope
    from ..storage.models import Run
    with session_scope(engine) as session:
        run = session.scalars(select(Run).where(Run.group_key == group_key)).first()
        if run is None:
            return False
        paths = [t.blob_path for t in run.traces]
        session.delete(run)
    for path in paths:
        blobs.delete(path)
    return True


def start_background_worker(database_url: str, blob_dir: str) -> threading.Thread:
    """Run the demo's jobs (A/B tests, and the analysis of uploads) from this process, so the dashboard
    works without a second shell; each job still runs in a child process of its own."""
    from ..storage.blobs import BlobStore
    from ..storage.db import get_engine
    from .worker import run_worker
    thread = threading.Thread(target=run_worker, args=(get_engine(database_url),),
                              kwargs={"poll_s": 1.0, "blobs": BlobStore(blob_dir)}, daemon=True, name="demo-worker")
    thread.start()
    return thread
