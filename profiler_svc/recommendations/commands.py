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
        write_output(args.output, text, args.trace)
    else:
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except BrokenPipeError:
            raise
        except OSError as exc:  # a full disk, a closed terminal
            from ..errors import UserError
            raise UserError(f"cannot write the report to standard output: {exc.strerror or exc}") from None
    if args.fail_on and report.findings:
        worst = report.worst_severity()
        if SEVERITIES.index(worst) >= SEVERITIES.index(args.fail_on):
            return 1
    return 0


def write_output(path, text, trace):
    """The report at PATH: a regular file, new or replaced whole (never half-written), with an existing file's
    mode (else the umask's) and through a symlink to its target; a device or a pipe written as it is. Never the
    trace being analysed."""
    import os
    import stat
    import tempfile
    from ..errors import UserError
    from ..trace.load import TRACE_SUFFIXES
    target = os.path.realpath(path)
    try:
        if os.path.exists(trace) and os.path.exists(target) and os.path.samefile(target, trace):
            raise UserError(f"--output {path} is the trace being analysed: write the report to another file")
        if os.path.isdir(trace) and os.path.samefile(os.path.dirname(target), trace) and target.endswith(TRACE_SUFFIXES):
            raise UserError(f"--output {path} is a trace file of the folder being analysed (or would be read as one "
                            "next time): write the report elsewhere")
        try:
            mode = os.stat(target).st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None and stat.S_ISDIR(mode):
            raise UserError(f"--output {path} is a folder: name a file")
        if mode is not None and not stat.S_ISREG(mode):  # /dev/null, a pipe: not ours to replace
            with open(target, "w", encoding="utf-8") as f:
                f.write(text)
            return
        if mode is None:
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".report-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.chmod(tmp, stat.S_IMODE(mode))
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as exc:
        raise UserError(f"cannot write {path}: {exc.strerror or exc}") from None
