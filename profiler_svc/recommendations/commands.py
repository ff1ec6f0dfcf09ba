"""`profiler_svc recommend TRACE`: analyse a trace from the command line."""
import sys

from .severity import SEVERITIES


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "recommend", help="analyse a trace and print ranked findings with recommended fixes",
        description="Analyse a Kineto/Chrome trace (.json or .json.gz from any torch.profiler run, or a folder of "
                    "per-rank traces) and print findings ranked by estimated saving.")
    p.add_argument("trace", metavar="TRACE", help="trace file (.json / .json.gz) or folder of per-rank traces")
    p.add_argument("--format", choices=("text", "table", "json", "markdown"), default="text",
                   help="output format (table: the same as text)")
    p.add_argument("--top", type=_positive, default=10, metavar="N", help="findings and kernels to show (default 10)")
    p.add_argument("--fail-on", choices=SEVERITIES, metavar="SEVERITY",
                   help=f"exit 1 if any finding is at least this severe ({', '.join(SEVERITIES)})")
    p.add_argument("--output", "-o", metavar="FILE", help="write the report here instead of stdout")
    p.add_argument("--progress", action="store_true", default=None, help="always show a progress bar on load")
    p.set_defaults(func=run)


def _positive(text):
    import argparse
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return value


def run(args) -> int:
    from .report import recommend, render_markdown, render_text  # pandas & co. only when analysing

    report = recommend(args.trace, top=max(args.top, 20), progress=args.progress)
    if args.format == "json":
        d = report.to_dict()
        d["findings"] = d["findings"][:args.top] if args.top else d["findings"]
        d["top_kernels"] = d["top_kernels"][:args.top]
        import json
        text = json.dumps(d, indent=2, ensure_ascii=False) + "\n"
    elif args.format == "markdown":
        text = render_markdown(report, args.top)
    else:
        text = render_text(report, args.top)
    if args.output:
        _write_atomic(args.output, text)
    else:
        sys.stdout.write(text)
    if args.fail_on and report.findings:
        worst = report.worst_severity()
        if SEVERITIES.index(worst) >= SEVERITIES.index(args.fail_on):
            return 1
    return 0


def _write_atomic(path, text):
    import os
    import tempfile
    from ..errors import UserError
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".report-")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
