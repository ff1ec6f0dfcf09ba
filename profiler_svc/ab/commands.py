"""`profiler_svc ab`: A/B-test swaps on a workload from the command line."""
from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from ..errors import UserError
from ..formats import one_line


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "ab", help="A/B-test fused-kernel swaps on a workload: parity vs fp64, then timing",
        description="Run the workload as given (A) and with the swaps applied (B): parity of outputs "
                    "(and loss and gradients with --train) against an fp64 run, then interleaved timed "
                    "rounds with a bootstrap confidence interval on the speedup. Exit 0, or 1 when parity "
                    "fails.")
    p.add_argument("--workload", required=True, metavar="PKG.MODULE:FACTORY",
                   help="a function returning (model, inputs) or (model, inputs, loss_fn)")
    p.add_argument("--swap", action="append", default=[], metavar="NAME",
                   help="a bundled swap to apply (repeatable)")
    p.add_argument("--from-report", type=Path, metavar="REPORT.json",
                   help="also apply every swap recommended in a `profiler_svc recommend --format json` report")
    p.add_argument("--train", action="store_true", help="time forward + backward, compare loss and gradients")
    p.add_argument("--rounds", type=int, default=30, help="timed rounds per variant (default 30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print ABResult.to_dict() as JSON")
    p.set_defaults(func=run_ab)


def run_ab(args) -> int:
    from . import ab_test, load_workload

    swaps = list(dict.fromkeys(args.swap + (swaps_from_report(args.from_report) if args.from_report else [])))
    if not swaps:
        raise UserError("nothing to test: give --swap NAME or --from-report REPORT.json")
    workload = load_workload(args.workload)
    started_at = datetime.now(timezone.utc)
    try:
        result = ab_test(workload.model, workload.inputs, swaps, train=args.train, loss_fn=workload.loss_fn,
                         rounds=args.rounds, warmup=args.warmup, seed=args.seed)
    except UserError:
        raise
    except Exception as err:  # the user's model failed: one line here, the traceback via ab_test in Python
        raise UserError(f"workload {args.workload} failed during the A/B test: {one_line(err)}") from None
    if args.json:
        json.dump(result.to_dict(), sys.stdout, indent=2, allow_nan=False)
        print()
    else:
        print(result.summary())
    sys.stdout.flush()
    params = {"train": args.train, "rounds": args.rounds, "warmup": args.warmup, "seed": args.seed}
    note = _store(result, args.workload, params, started_at)  # after printing: a storage error keeps the result
    if note:
        print(note, file=sys.stderr)
    return 1 if result.verdict == "parity_failed" else 0


def swaps_from_report(path: Path) -> list[str]:
    """Every bundled swap a `recommend` JSON report recommends, in findings order, once each."""
    from ..recommendations.report import SCHEMA  # here, not at the top: the analyser loads pandas

    try:
        report = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise UserError(f"report {path} does not exist") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise UserError(f"cannot read report {path}: {err}") from None
    if not isinstance(report, dict) or report.get("schema") != SCHEMA:
        raise UserError(f"{path} is not a `profiler_svc recommend --format json` report "
                        f"(no schema {SCHEMA!r})")
    findings = report.get("findings")
    if not isinstance(findings, list):
        raise UserError(f"report {path} has no findings list")
    swaps = [((f.get("recommendation") or {}).get("swap") if isinstance(f, dict) else None) for f in findings]
    swaps = list(dict.fromkeys(s for s in swaps if isinstance(s, str) and s))
    if not swaps:
        raise UserError(f"report {path} recommends no bundled swap")
    return swaps


def _store(result, workload: str, params: dict, started_at) -> str | None:
    """Save to the configured database (PROFILER_SVC_DATABASE_URL) as a done A/B job; a line saying so."""
    from ..storage.db import DATABASE_URL_ENV

    if not os.environ.get(DATABASE_URL_ENV):
        return None
    from ..storage import save_ab_result
    try:
        job_id = save_ab_result(result.to_dict(), workload=workload, params=params, started_at=started_at)
    except UserError:
        raise
    except Exception as err:  # the database is unreachable or not migrated: the result above still stands
        raise UserError(f"result not stored: {one_line(err)}") from None
    return f"stored as A/B job {job_id}"
