"""Hostile traces against the loader: peak memory and time vs decompressed size, each in a fresh process.

    python benchmarks/loader_bombs.py [--sizes 64,256,1024] [--dir .bench/bombs] [--pythonpath OLD_CHECKOUT]

Makes (once, cached in --dir) gzip bombs and plain files of each kind at each decompressed size in MiB, then runs
`python -m profiler_svc.cli recommend FILE --format json -o /dev/null` on each under /usr/bin/time, printing a
markdown table of exit status, wall time, peak RSS and the one-line error. --pythonpath runs another checkout's
package instead (PYTHONPATH=DIR), for a before/after comparison. Kinds:

- whitespace: `{"traceEvents": [` + spaces + `]}`: nothing but whitespace between events
- whitespace in an event: one event whose fields are separated by the spaces
- unknown field: one event with one huge string field the schema does not read
- unknown events: 1 kB events of a category the analyser does not keep, each with an unknown field
"""
import argparse
import os
import platform
import subprocess
import sys
import tempfile
import zlib
from pathlib import Path

MIB = 1 << 20
KINDS = {
    "whitespace": (b'{"traceEvents": [', b" ", b"]}"),
    "whitespace in an event": (b'{"traceEvents": [{"ph": "X", "cat": "kernel",', b" ", b'"name": "k"}]}'),
    "unknown field": (b'{"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "junk": "', b"a", b'"}]}'),
    "unknown events": (b'{"traceEvents": [{"ph": "X", "cat": "x"}',
                       b', {"ph": "X", "cat": "x", "ts": 1, "dur": 1, "junk": "' + b"a" * 940 + b'"}\n', b"]}"),
}


def write(path: Path, kind: str, size: int, packed: bool) -> None:
    """HEAD + FILL repeated to SIZE bytes + TAIL, gzipped (level 9, as a bomb is) or not, in constant memory."""
    head, fill, tail = KINDS[kind]
    block = fill * max(1, (4 * MIB) // len(fill))
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31) if packed else None
    with open(path, "wb") as f:
        emit = (lambda b: f.write(compressor.compress(b))) if packed else f.write
        emit(head)
        left = size - len(head) - len(tail)
        while left > 0:
            piece = block[:left - left % len(fill)] if left < len(block) else block
            if not piece:
                break
            emit(piece)
            left -= len(piece)
        emit(tail)
        if packed:
            f.write(compressor.flush())


def run(path: Path, pythonpath: str | None) -> tuple[int, float, float, str]:
    """(exit status, wall s, peak RSS MiB, last stderr line) of `recommend` on PATH in a fresh process."""
    env = dict(os.environ)
    if pythonpath:
        env["PYTHONPATH"] = pythonpath
    with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
        # run outside the checkout: `python -m` puts the working folder before PYTHONPATH
        proc = subprocess.run(["/usr/bin/time", "-f", "%e %M", "-o", out.name, sys.executable, "-m",
                               "profiler_svc.cli", "recommend", str(path.resolve()), "--format", "json",
                               "-o", os.devnull],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=tempfile.gettempdir())
        lines = out.read().split("\n")
    wall, rss_kb = next(line for line in lines if line and line[0].isdigit()).split()
    said = [line for line in proc.stderr.splitlines() if line.strip()]
    return proc.returncode, float(wall), int(rss_kb) / 1024, (said[-1] if said else "")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="64,256,1024", help="decompressed sizes in MiB (default 64,256,1024)")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated kinds (default: all)")
    parser.add_argument("--plain", action="store_true", help="also plain (not gzipped) files of each kind")
    parser.add_argument("--dir", default=".bench/bombs", help="where the files are made and kept")
    parser.add_argument("--pythonpath", help="run the package found here instead (another checkout)")
    args = parser.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    import msgspec
    import numpy
    print(f"{platform.machine()}, {os.cpu_count()} cores; Python {platform.python_version()}, "
          f"msgspec {msgspec.__version__}, numpy {numpy.__version__}; package: {args.pythonpath or 'this checkout'}")
    print()
    print("| kind | file | decompressed MiB | on disk MiB | exit | wall s | peak RSS MiB | says |")
    print("|---|---|---|---|---|---|---|---|")
    for kind in args.kinds.split(","):
        for packed in (True, False) if args.plain else (True,):
            for size in (int(s) for s in args.sizes.split(",")):
                path = folder / f"{kind.replace(' ', '_')}_{size}MiB.json{'.gz' if packed else ''}"
                if not path.exists():
                    write(path, kind, size * MIB, packed)
                code, wall, rss, said = run(path, args.pythonpath)
                said = said.replace(str(path.resolve()), "FILE").replace("|", "\\|")[:110]
                print(f"| {kind} | {'gzip' if packed else 'plain'} | {size} | {path.stat().st_size / MIB:.2f} | "
                      f"{code} | {wall:.2f} | {rss:.0f} | {said} |", flush=True)


if __name__ == "__main__":
    main()
