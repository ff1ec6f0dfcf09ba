"""Analysis speed and memory: `profiler_svc recommend` end to end vs Holistic Trace Analysis.

    python benchmarks/tile_trace.py tests/data/llama_bf16_train.json.gz .bench/hta/trace.json --events 1000000
    python benchmarks/analysis_vs_hta.py .bench/hta/trace.json [--repeat 3]

Each tool runs in its own fresh process (imports included) under /usr/bin/time, which reports wall time
and peak RSS. HTA does TraceAnalysis load + get_gpu_kernel_breakdown + get_idle_time_breakdown (its
comparable analyses); we run the full `recommend` (load, all detectors, report). Median of --repeat runs.
"""
import argparse
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


def timed(cmd) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one command."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
        proc = subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", out.name, *cmd],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        wall, rss_kb = out.read().split()[-2:]
    return float(wall), int(rss_kb) / 1024


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    trace = Path(args.trace).resolve()
    hta_dir = Path(tempfile.mkdtemp(prefix="hta-"))
    os.symlink(trace, hta_dir / trace.name)  # HTA reads a folder of rank traces
    ours_cmd = [sys.executable, "-m", "profiler_svc.cli", "recommend", str(trace), "--format", "json",
                "-o", os.devnull]
    hta_cmd = [sys.executable, "-c", HTA_SCRIPT, str(hta_dir)]
    results = {"profiler_svc recommend": [], "HTA load + kernel + idle breakdown": []}
    for _ in range(args.repeat):  # interleaved, so drift hits both alike
        results["profiler_svc recommend"].append(timed(ours_cmd))
        results["HTA load + kernel + idle breakdown"].append(timed(hta_cmd))
    shutil.rmtree(hta_dir)
    import msgspec, pandas  # noqa: E401  (versions for the table)
    try:
        from importlib.metadata import version
        hta_version = version("HolisticTraceAnalysis")
    except Exception:
        hta_version = "?"
    print(f"trace: {trace.name}, {trace.stat().st_size / 1e6:.0f} MB; {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} cores; Python {platform.python_version()}, pandas {pandas.__version__}, "
          f"msgspec {msgspec.__version__}, HTA {hta_version}; median of {args.repeat}")
    print(f"{'tool':38} {'wall s':>8} {'peak RSS MiB':>13}")
    medians = {}
    for name, runs in results.items():
        wall = statistics.median(r[0] for r in runs)
        rss = statistics.median(r[1] for r in runs)
        medians[name] = (wall, rss)
        print(f"{name:38} {wall:8.1f} {rss:13.0f}")
    (ow, orss), (hw, hrss) = medians.values()
    print(f"speed-up {hw / ow:.1f}x, memory {orss / hrss:.2f} of HTA's")


if __name__ == "__main__":
    main()
