"""Run-page latency for a run ingested from a ~1M-event trace (the bar: under 300 ms).

    python benchmarks/run_page.py [--trace BIG.json.gz] [--events 1000000] [--database-url URL]

Without --trace, tiles tests/data/qwen2_bf16_decode.json.gz (a real H200 decode trace) to about
--events events with benchmarks/tile_trace.py. Ingests it once (timed: analysis + storage), then
serves the run page and its JSON through a real HTTP server (gunicorn-less: Werkzeug, one thread)
and reports the median and max of --repeat requests each. Work files go to .bench/run_page/.
"""
import argparse
import gzip
import json
import logging
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def make_trace(out: Path, events: int) -> Path:
    from tile_trace import tile
    if out.exists():
        return out
    source = json.loads(gzip.decompress((ROOT / "tests/data/qwen2_bf16_decode.json.gz").read_bytes()))
    with gzip.open(out, "wt", compresslevel=3) as f:
        json.dump(tile(source, events), f)
    return out


def fetch(url: str) -> tuple[float, int]:
    start = time.perf_counter()
    with urllib.request.urlopen(url) as response:
        body = response.read()
    return (time.perf_counter() - start) * 1000, len(body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--database-url")
    parser.add_argument("--repeat", type=int, default=30)
    args = parser.parse_args()

    work = ROOT / ".bench" / "run_page"
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PROFILER_SVC_HOME", str(work / "home"))
    trace = args.trace or make_trace(work / f"tiled_{args.events}.json.gz", args.events)
    url = args.database_url or f"sqlite:///{work / 'bench.sqlite3'}"

    from werkzeug.serving import make_server

    from profiler_svc.storage.blobs import BlobStore
    from profiler_svc.storage.db import get_engine, upgrade
    from profiler_svc.storage.ingest import ingest_path
    from profiler_svc.web import create_app

    engine = get_engine(url)
    upgrade(engine)
    start = time.perf_counter()
    [result] = ingest_path(engine, trace, blobs=BlobStore(work / "blobs"))
    ingest_s = time.perf_counter() - start

    app = create_app({"DATABASE_URL": url, "BLOB_DIR": str(work / "blobs")})
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.port}"
    run_json = json.loads(urllib.request.urlopen(f"{base}/api/v1/runs/{result.run_id}").read())

    print(f"trace: {trace} ({run_json['summary']['event_count']} events, "
          f"{run_json['summary']['kernel_count']} kernels)")
    print(f"ingest: {ingest_s:.1f} s ({'already stored' if result.duplicate else 'analysis + storage'})")
    print(f"database: {engine.url.render_as_string(hide_password=True)}")
    for path in (f"/runs/{result.run_id}", f"/api/v1/runs/{result.run_id}"):
        fetch(base + path)  # warm: templates compiled, connection pooled
        times = [fetch(base + path) for _ in range(args.repeat)]
        ms = [t for t, _ in times]
        print(f"GET {path}: median {statistics.median(ms):.1f} ms, max {max(ms):.1f} ms "
              f"over {args.repeat} requests ({times[0][1] / 1024:.0f} KiB)")
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
