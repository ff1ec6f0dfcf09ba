"""Dashboard latency, every view, for a run ingested from a ~1M-event trace (the bars: under 300 ms warm,
under 1 s cold to the browser's load event).

    python benchmarks/run_page.py [--trace BIG.json.gz] [--events 1000000] [--database-url URL] [--out FILE]

Without --trace, tiles tests/data/qwen2_bf16_decode.json.gz (a real H200 decode trace) to about --events
events with benchmarks/tile_trace.py. Ingests it once (timed: analysis + storage), plus what the other views
need to draw their charts: the untiled source trace (compare: source against the big run) and a real H100
A/B result (benchmarks/results/ab_llama.json) stored as a done job of the big run (the job page's violins).
Then serves the app through a real HTTP server (Werkzeug, threaded) and measures every view (runs, run,
modules, timeline, compare, jobs, job):
- server: the median and max of --repeat requests, and the bytes sent gzip-compressed and not;
- browser (when Playwright and chromium are installed): time to the load event with a cold cache (a new
  browser context: Plotly and the static files fetched) and warm (the same context, reloaded); the median
  of --browser-repeat fresh contexts. Also, cold and warm, the time until the charts on the first screen are
  drawn (the later of the load event and their "chart drawn <id>" performance marks, which app.js sets; a
  page without the marks draws every chart before its load event), and, warm, how long a chart below the
  first screen (drawn only when it scrolls near) takes from the scroll to drawn.
Work files go to .bench/run_page/; --out writes the figures as JSON (benchmarks/results/ keeps histories).
"""
import argparse
import gzip
import json
import logging
import os
import shutil
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


SOURCE = ROOT / "tests/data/qwen2_bf16_decode.json.gz"
AB_RESULTS = ROOT / "benchmarks/results/ab_llama.json"


def make_trace(out: Path, events: int) -> Path:
    from tile_trace import tile
    if out.exists():
        return out
    source = json.loads(gzip.decompress(SOURCE.read_bytes()))
    with gzip.open(out, "wt", compresslevel=3) as f:
        json.dump(tile(source, events), f)
    return out


def ab_job(engine, run_id: int) -> int:
    """A done A/B job of the run holding a real GPU result (timing: the job page draws its violins); stored
    once."""
    from sqlalchemy import select

    from profiler_svc.storage import save_ab_result
    from profiler_svc.storage.db import session_scope
    from profiler_svc.storage.models import ABJob

    with session_scope(engine) as session:
        job = session.scalars(select(ABJob.id).where(ABJob.run_id == run_id)).first()
    if job is not None:
        return job

    def first_result(o):
        if isinstance(o, dict):
            if {"verdict", "device", "timing"} <= o.keys() and o["timing"]:
                return o
            o = list(o.values())
        for v in o if isinstance(o, list) else []:
            found = first_result(v)
            if found:
                return found
        return None

    result = first_result(json.loads(AB_RESULTS.read_text()))
    return save_ab_result(result, workload="benchmarks/ab_end_to_end.py", run_id=run_id, engine=engine,
                          source="sample", worker=f"{result['device']} ({AB_RESULTS.name})")


def fetch(url: str, gzip_ok: bool = True) -> tuple[float, int]:
    request = urllib.request.Request(url, headers={"Accept-Encoding": "gzip"} if gzip_ok else {})
    start = time.perf_counter()
    with urllib.request.urlopen(request) as response:
        body = response.read()
    return (time.perf_counter() - start) * 1000, len(body)


def server_times(base: str, paths: list[str], repeat: int) -> dict:
    out = {}
    for path in paths:
        fetch(base + path)  # warm: templates compiled, connection pooled
        times = [fetch(base + path) for _ in range(repeat)]
        ms = [t for t, _ in times]
        out[path] = {"median_ms": round(statistics.median(ms), 1), "max_ms": round(max(ms), 1),
                     "gzip_bytes": times[0][1], "bytes": fetch(base + path, gzip_ok=False)[1]}
        print(f"GET {path}: median {out[path]['median_ms']} ms, max {out[path]['max_ms']} ms over {repeat}; "
              f"{out[path]['gzip_bytes'] / 1024:.0f} KiB gzip ({out[path]['bytes'] / 1024:.0f} KiB raw)")
    return out


def browser_times(base: str, paths: list[str], repeat: int = 1) -> dict:
    """Load-event times in headless chromium: cold (new context, empty cache) and warm (reload); each the
    median of `repeat` new contexts."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("browser: playwright not installed, skipped")
        return {}
    chromium = os.environ.get("PROFILER_SVC_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"
    if not os.path.exists(chromium):
        print("browser: chromium not installed, skipped")
        return {}
    load_ms = "performance.getEntriesByType('navigation')[0].loadEventEnd"
    paint_ms = "(performance.getEntriesByName('first-contentful-paint')[0] || {startTime: null}).startTime"
    # the charts on the first screen (the page scrolled to the top): drawn, and by when
    on_screen = "[...document.querySelectorAll('.chart')].filter(c => c.getBoundingClientRect().top < innerHeight)"
    screen_drawn = f"{on_screen}.every(c => c.querySelector('.main-svg'))"
    screen_drawn_ms = (f"Math.max({load_ms}, ...{on_screen}.map(c => (performance.getEntriesByName('chart drawn ' + c.id)"
                       f"[0] || {{startTime: 0}}).startTime))")
    # below it: scrolled to, one at a time, the time from the scroll to drawn
    below = "[...document.querySelectorAll('.chart')].filter(c => !c.querySelector('.main-svg')).map(c => c.id)"
    scroll_to = ("async id => { const c = document.getElementById(id), t = performance.now(); c.scrollIntoView();"
                 " while (!c.querySelector('.main-svg')) await new Promise(r => setTimeout(r, 1));"
                 " const m = performance.getEntriesByName('chart drawn ' + id)[0];"
                 " return (m ? m.startTime : performance.now()) - t; }")
    out = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--headless", "--no-sandbox", "--disable-gpu"])
        out["chromium"] = browser.version
        for path in paths:
            trials = []
            for _ in range(repeat):
                context = browser.new_context(viewport={"width": 1400, "height": 1000})
                page = context.new_page()
                page.on("pageerror", lambda exc, path=path: print(f"browser {path}: page error: {exc}"))
                page.goto(base + path, wait_until="load")
                cold, paint = page.evaluate(load_ms), page.evaluate(paint_ms)
                page.wait_for_function(screen_drawn)
                charts = page.evaluate(screen_drawn_ms)
                page.reload(wait_until="load")
                warm = page.evaluate(load_ms)
                page.wait_for_function(screen_drawn)
                warm_charts = page.evaluate(screen_drawn_ms)
                scroll = max((page.evaluate(scroll_to, id) for id in page.evaluate(below)), default=None)
                context.close()
                trials.append((cold, paint, charts, warm, warm_charts, scroll))
            # chromium reports no first contentful paint when the load event came first
            cold, paint, charts, warm, warm_charts, scroll = (
                statistics.median(v) if (v := [t[i] for t in trials if t[i] is not None]) else None for i in range(6))
            out[path] = {"cold_load_ms": round(cold, 1), "cold_first_paint_ms": paint and round(paint, 1),
                         "cold_charts_drawn_ms": round(charts, 1), "warm_load_ms": round(warm, 1),
                         "warm_charts_drawn_ms": round(warm_charts, 1),
                         "warm_below_fold_drawn_after_scroll_ms": scroll and round(scroll, 1), "trials": repeat}
            print(f"browser {path}: cold: first paint {f'{paint:.0f} ms' if paint else '–'}, load event {cold:.0f} ms, "
                  f"first screen's charts drawn by {charts:.0f} ms; warm: load event {warm:.0f} ms, charts by "
                  f"{warm_charts:.0f} ms" + (f", below the first screen {scroll:.0f} ms after the scroll" if scroll else "")
                  + f" (medians of {repeat})")
        browser.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trace", type=Path)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--database-url")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--browser-repeat", type=int, default=3, help="new browser contexts per view (median)")
    parser.add_argument("--no-browser", action="store_true", help="server timings only")
    parser.add_argument("--out", type=Path, help="write the figures here as JSON")
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
    [other] = ingest_path(engine, SOURCE, blobs=BlobStore(work / "blobs"), name="compare: the untiled source")
    job_id = ab_job(engine, result.run_id)

    app = create_app({"DATABASE_URL": url, "BLOB_DIR": str(work / "blobs"), "PUBLIC_READ": True})  # reads open
    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # no line per request
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.port}"
    run_id = result.run_id
    run_json = json.loads(urllib.request.urlopen(f"{base}/api/v1/runs/{run_id}").read())

    print(f"trace: {trace} ({run_json['summary']['event_count']} events, "
          f"{run_json['summary']['kernel_count']} kernels)")
    print(f"ingest: {ingest_s:.1f} s ({'already stored' if result.duplicate else 'analysis + storage'})")
    print(f"database: {engine.url.render_as_string(hide_password=True)}")
    views = ["/", f"/runs/{run_id}", f"/runs/{run_id}/modules", f"/runs/{run_id}/timeline",
             f"/compare?a={other.run_id}&b={run_id}", "/jobs", f"/jobs/{job_id}"]
    figures = {"trace": str(trace), "events": run_json["summary"]["event_count"],
               "kernels": run_json["summary"]["kernel_count"], "ingest_s": round(ingest_s, 2),
               "database": engine.dialect.name,
               "server": server_times(base, views + [f"/api/v1/runs/{run_id}", f"/api/v1/runs/{run_id}/timeline"],
                                      args.repeat),
               "browser": {} if args.no_browser else browser_times(base, views, args.browser_repeat)}
    server.shutdown()
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
