"""Analysis speed and memory: `profiler_svc recommend` end to end vs Holistic Trace Analysis.

    python benchmarks/tile_trace.py tests/data/agent/llama8_bf16_4x1024_train_calibrated.json.gz .bench/hta/llama8.json
    python benchmarks/analysis_vs_hta.py .bench/hta/llama8.json [more traces] [--repeat 2] [--out FILE.md]

Each tool runs in its own fresh process (imports included) under /usr/bin/time, which reports wall time,
CPU time (user + system) and peak RSS; the two tools alternate, so drift on a shared machine hits both alike.
HTA does TraceAnalysis load + get_gpu_kernel_breakdown + get_idle_time_breakdown (its comparable analyses);
we run the full `recommend` (load, every detector, the what-if replay and calibration, the report).
With --hta-linear-steps, HTA runs with its per-event ProfilerStep scan made linear (hta_linear_steps.py): on a
tiled trace's hundreds of steps that scan is most of HTA's time.
With --out, the run is appended to that markdown file (created with a header if absent): the bar, the
machine, versions, the command, and for each trace its size in events and MB, every run and the medians.
"""
import argparse
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HTA_SCRIPT = """
import sys
from hta.trace_analysis import TraceAnalysis
analyzer = TraceAnalysis(trace_dir=sys.argv[1])
analyzer.get_gpu_kernel_breakdown(visualize=False)
analyzer.get_idle_time_breakdown(visualize=False)
"""
OURS, HTA = "profiler_svc recommend", "HTA load + kernel + idle breakdown"
SPEED_BAR, MEMORY_BAR = 5.0, 1 / 3
HEADER = f"""# `profiler_svc recommend` vs Holistic Trace Analysis on ~1M-event traces

**Bar:** on real traces of different shapes tiled to ~1M events, `recommend` end to end (load, every
detector, the what-if replay, the report) at least {SPEED_BAR:g}x faster than HTA's load + kernel breakdown +
idle breakdown on the same file and machine, with at most a third of its peak memory.

Written by `benchmarks/analysis_vs_hta.py --out` (one section per run, newest last). Wall time is what a
user waits; on a shared machine it swings with what else runs, so CPU time (user + system, which HTA's
and our single-threaded work both count in full) is given beside it.
"""


def timed(cmd) -> dict:
    """Wall seconds, CPU seconds and peak RSS MiB of one command."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
        proc = subprocess.run(["/usr/bin/time", "-f", "%e %U %S %M", "-o", out.name, *cmd],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        wall, user, system, rss_kb = out.read().split()[-4:]
    return {"wall": float(wall), "cpu": float(user) + float(system), "rss": int(rss_kb) / 1024}


def event_count(trace: Path) -> int:
    from profiler_svc.trace.load import load_trace
    return load_trace(trace).event_count


def measure(trace: Path, repeat: int, hta_linear_steps: bool) -> dict:
    hta_dir = Path(tempfile.mkdtemp(prefix="hta-"))
    os.symlink(trace, hta_dir / trace.name)  # HTA reads a folder of rank traces
    ours_cmd = [sys.executable, "-m", "profiler_svc.cli", "recommend", str(trace), "--format", "json",
                "-o", os.devnull]
    hta_cmd = ([sys.executable, str(Path(__file__).parent / "hta_linear_steps.py"), str(hta_dir)]
               if hta_linear_steps else [sys.executable, "-c", HTA_SCRIPT, str(hta_dir)])
    runs = []
    try:
        for i in range(repeat):  # interleaved, so drift hits both alike
            ours, hta = timed(ours_cmd), timed(hta_cmd)
            runs.append({"ours": ours, "hta": hta, "load": os.getloadavg()[0]})
            print(f"  {trace.name} run {i + 1}: ours {ours['wall']:.1f} s wall {ours['cpu']:.1f} s CPU "
                  f"{ours['rss']:.0f} MiB; HTA {hta['wall']:.1f} s wall {hta['cpu']:.1f} s CPU {hta['rss']:.0f} MiB",
                  flush=True)
    finally:
        shutil.rmtree(hta_dir)
    return {"trace": trace, "events": event_count(trace), "mb": trace.stat().st_size / 1e6, "runs": runs}


def _median(runs, tool, key):
    return statistics.median(r[tool][key] for r in runs)


def versions() -> str:
    import msgspec
    import numpy
    import pandas
    from importlib.metadata import version
    try:
        hta = version("HolisticTraceAnalysis")
    except Exception:
        hta = "?"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip() or "?"
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30
    return (f"{platform.machine()}, {os.cpu_count()} cores, {mem:.0f} GiB; Python {platform.python_version()}, "
            f"numpy {numpy.__version__}, pandas {pandas.__version__}, msgspec {msgspec.__version__}, "
            f"HolisticTraceAnalysis {hta}; profiler_svc at {commit}")


def markdown(results: list, argv: list, started: str, load_before: float) -> str:
    lines = [f"## Run of {started}", "",
             f"- Command: `python benchmarks/analysis_vs_hta.py {' '.join(argv)}`",
             f"- Machine: {versions()}",
             f"- Load average (1 min) before the run: {load_before:.1f}; after each pair of runs in the table.", "",
             "| trace | events | MB | run | ours wall s | ours CPU s | ours peak MiB | HTA wall s | HTA CPU s "
             "| HTA peak MiB | speed-up wall | speed-up CPU | memory vs HTA | load |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    verdicts = []
    for res in results:
        for i, r in enumerate(res["runs"], 1):
            o, h = r["ours"], r["hta"]
            lines.append(f"| {res['trace'].name} | {res['events']:,} | {res['mb']:.0f} | {i} | {o['wall']:.1f} | "
                         f"{o['cpu']:.1f} | {o['rss']:.0f} | {h['wall']:.1f} | {h['cpu']:.1f} | {h['rss']:.0f} | "
                         f"{h['wall'] / o['wall']:.1f}x | {h['cpu'] / o['cpu']:.1f}x | {o['rss'] / h['rss']:.2f} | "
                         f"{r['load']:.1f} |")
        runs = res["runs"]
        walls = [r["hta"]["wall"] / r["ours"]["wall"] for r in runs]
        cpus = [r["hta"]["cpu"] / r["ours"]["cpu"] for r in runs]
        mems = [r["ours"]["rss"] / r["hta"]["rss"] for r in runs]
        memory_met = max(mems) <= MEMORY_BAR
        met = {"wall": min(walls) >= SPEED_BAR and memory_met, "CPU": min(cpus) >= SPEED_BAR and memory_met}
        verdicts.append(f"- {res['trace'].name}: speed-up {min(walls):.1f}-{max(walls):.1f}x wall, "
                        f"{min(cpus):.1f}-{max(cpus):.1f}x CPU; memory {min(mems):.2f}-{max(mems):.2f} of HTA's "
                        f"(median ours {_median(runs, 'ours', 'wall'):.1f} s / {_median(runs, 'ours', 'rss'):.0f} MiB, "
                        f"HTA {_median(runs, 'hta', 'wall'):.1f} s / {_median(runs, 'hta', 'rss'):.0f} MiB). Bar "
                        + "; ".join(f"by {k} time {'met in every run' if v else 'not met'}"
                                    for k, v in met.items()))
    return "\n".join(lines + ["", "Per trace (the range over its runs):", ""] + verdicts) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--out", help="markdown file to append this run to")
    parser.add_argument("--hta-linear-steps", action="store_true",
                        help="HTA with its O(events x steps) ProfilerStep lookup made linear")
    args = parser.parse_args()
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    load_before = os.getloadavg()[0]
    results = [measure(Path(t).resolve(), args.repeat, args.hta_linear_steps) for t in args.traces]
    text = markdown(results, sys.argv[1:], started, load_before)
    print(text)
    if args.out:
        out = Path(args.out)
        previous = out.read_text() if out.exists() else HEADER
        out.write_text(previous.rstrip("\n") + "\n\n" + text)


if __name__ == "__main__":
    main()
