"""The `profiler_svc` command line: one subcommand per stage of the loop.

Each area adds its own subcommands through an ``add_commands(subparsers)`` function; every
subcommand sets ``func(args) -> int`` (the exit status). A ``UserError`` anywhere becomes one line
on stderr and exit 2.
"""
import argparse
import importlib
import sys

from .errors import UserError
from .formats import clean, error_line

# Areas that contribute subcommands, in help order. Each module defines add_commands(subparsers).
COMMAND_MODULES = (
    "profiler_svc.recommendations.commands",
    "profiler_svc.ab.commands",
    "profiler_svc.service.commands",
)


class _Parser(argparse.ArgumentParser):
    """Argument errors in one line, as every other error (its subcommands' parsers are of this class too)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {clean(message)} (see {self.prog} -h)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="profiler_svc",
        description="Find why a PyTorch workload is slow, recommend fused kernels, A/B-test the swap.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency inside the module: surface it
                raise
            continue
        module.add_commands(subparsers)
    return parser


def _version() -> str:
    from . import __version__
    return __version__


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except UserError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("profiler_svc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `profiler_svc recommend t.json | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
