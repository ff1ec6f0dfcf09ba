"""`profiler_svc demo`: bundled GPU traces plus a live CPU capture, in a SQLite file of its own.

The bundled traces (``profiler_svc/samples``) were captured on an H200 (see the manifest there);
the live capture profiles `tiny_llama` on this machine. ``tiny_llama`` is also the run's
workload, so the dashboard's "A/B test this swap" works on this machine (on CPU through
Triton's interpreter when there is no GPU).
"""
import os
import secrets
import threading
from pathlib import Path

SAMPLES = Path(__file__).resolve().parents[1] / "samples"
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
    """Ingest the samples (ranks of one job grouped) and a live capture; returns the Flask app."""
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
    # a sample is a trace file, or a folder of one job's per-rank traces (one run)
    for path in sorted(p for p in SAMPLES.iterdir() if p.is_dir() or p.name.endswith(".json.gz")):
        name = path.name.removesuffix(".json.gz")
        results = ingest_path(engine, path, blobs=blobs, name=name, group_key=f"sample:{name}",
                              host="H200 (bundled sample)")
        stored = "already stored" if all(r.duplicate for r in results) else f"{len(results)} trace(s)"
        print_fn(f"sample {path.name}: run {results[0].run_id} ({stored})")
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
