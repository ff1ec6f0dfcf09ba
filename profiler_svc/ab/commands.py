"""`profiler_svc ab`: A/B-test swaps and fixes on a workload from the command line."""
from __future__ import annotations

import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from ..detectors.common import recommended
from ..fix_names import FIX_NAMES, OPTIMIZER_FIXES
from ..errors import UserError
from ..formats import one_line


def add_commands(subparsers) -> None:
    p = subparsers.add_parser(
        "ab", help="A/B-test fused-kernel swaps and configuration fixes on a workload: parity vs fp64, then timing",
        description="Run the workload as given (A) and with the swaps and fixes applied (B): parity of outputs "
                    "(and loss and gradients with --train) against an fp64 run, then interleaved timed "
                    "rounds with a 95% confidence interval on the speedup. A fix that changes precision "
                    "(tf32, bf16_autocast) is judged by its numeric cost within --max-rel-error. Exit 0, or 1 "
                    "when parity fails.")
    p.add_argument("--workload", required=True, metavar="PKG.MODULE:FACTORY",
                   help="a function returning (model, inputs), (model, inputs, loss_fn) or "
                        "(model, inputs, loss_fn, optimizer)")
    p.add_argument("--swap", action="append", default=[], metavar="NAME",
                   help="a bundled swap to apply (repeatable)")
    p.add_argument("--fix", action="append", default=[], metavar="NAME",
                   help="a configuration fix to apply (repeatable): " + ", ".join(FIX_NAMES))
    p.add_argument("--from-report", type=Path, metavar="REPORT.json",
                   help="also apply every swap and fix recommended in a `profiler_svc recommend --format json` "
                        "report; the result keeps the report's predicted step change beside the measured one")
    p.add_argument("--max-rel-error", type=float, metavar="X",
                   help="the numeric cost you accept from a precision fix: normwise relative error vs fp64, "
                        "per output, loss and gradient (default: reported, not gated)")
    p.add_argument("--train", action="store_true", help="time forward + backward, compare loss and gradients")
    p.add_argument("--rounds", type=int, default=30,
                   help="timed rounds per variant (default 30; fewer than 6 cannot show a difference)")
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default 5)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print ABResult.to_dict() as JSON")
    p.set_defaults(func=run_ab)


def run_ab(args) -> int:
    from . import ab_test, load_workload

    recommended = recommended_in_report(args.from_report) if args.from_report else {"swaps": [], "fixes": []}
    swaps = list(dict.fromkeys(args.swap + recommended["swaps"]))
    fixes = list(dict.fromkeys(args.fix + recommended["fixes"]))
    if not swaps and not fixes:
        raise UserError("nothing to test: give --swap NAME, --fix NAME or --from-report REPORT.json")
    unknown = [f for f in fixes if f not in FIX_NAMES]
    if unknown:
        raise UserError(f"unknown fix {', '.join(map(repr, unknown))}; available: {', '.join(FIX_NAMES)}")
    for fix in OPTIMIZER_FIXES:
        if fix in args.fix and not args.train:
            raise UserError(f"--fix {fix} needs --train: the optimizer steps only in a training step")
    # predicted for what ran (a swap that matched no module and a fix that did not apply are left out), from the
    # trace the report names now (the report may move while the A/B runs), read before the workload loads
    trace = report_trace(args.from_report) if args.from_report else None
    workload = load_workload(args.workload)
    prediction = (lambda ran, applied: predicted_change(trace, ran, applied)) if trace else None
    started_at = datetime.now(timezone.utc)
    try:
        result = ab_test(workload.model, workload.inputs, swaps, fixes=fixes, train=args.train,
                         loss_fn=workload.loss_fn, optimizer=workload.optimizer if args.train else None, rounds=args.rounds,
                         warmup=args.warmup, seed=args.seed, max_rel_error=args.max_rel_error,
                         prediction=prediction)
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
    params = {"train": args.train, "rounds": args.rounds, "warmup": args.warmup, "seed": args.seed,
              "swaps": swaps, "fixes": fixes, "max_rel_error": args.max_rel_error}
    note = _store(result, args.workload, params, started_at)  # after printing: a storage error keeps the result
    if note:
        print(note, file=sys.stderr)
    return 1 if result.verdict == "parity_failed" else 0


def recommended_in_report(path: Path) -> dict[str, list[str]]:
    """Every bundled swap and fix a `recommend` JSON report recommends, in findings order, once each."""
    report = _read_report(path)
    recommendations = [(f.get("recommendation") or {}) if isinstance(f, dict) else {} for f in report["findings"]]
    found = {kinds: list(dict.fromkeys(name for name in (recommended(r, kind) for r in recommendations
                                                         if isinstance(r, dict)) if name))
             for kinds, kind in (("swaps", "swap"), ("fixes", "fix"))}
    if not found["swaps"] and not found["fixes"]:
        raise UserError(f"report {path} recommends no bundled swap or fix")
    return found


def swaps_from_report(path: Path) -> list[str]:
    """Every bundled swap a `recommend` JSON report recommends (see recommended_in_report)."""
    return recommended_in_report(path)["swaps"]


def report_trace(path: Path) -> str | None:
    """The trace a report was made from, where it is now (a relative path: from the report's folder too); None,
    with a line on stderr, when it is not here."""
    trace = (_read_report(path).get("source") or {}).get("path")
    if isinstance(trace, str) and not Path(trace).exists() and (Path(path).parent / trace).exists():
        trace = str(Path(path).parent / trace)  # a relative path, from where the report was written
    if not isinstance(trace, str) or not Path(trace).exists():
        print(f"no prediction: the report's trace {trace!r} is not here to replay", file=sys.stderr)
        return None
    return trace


def predicted_change(trace: str, swaps: list[str], fixes: list[str]) -> dict | None:
    """The analyser's predicted step change for exactly these swaps and fixes: the trace replayed again
    (Report.predict); None, with a line on stderr, when that fails."""
    from ..recommendations import recommend

    try:
        return recommend(trace).predict(swaps=swaps, fixes=fixes) or None
    except Exception as err:  # the A/B test still stands without a prediction
        print(f"no prediction: replaying {trace} failed ({one_line(err)})", file=sys.stderr)
        return None


def _read_report(path: Path) -> dict:
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
    if not isinstance(report.get("findings"), list):
        raise UserError(f"report {path} has no findings list")
    if not isinstance(report.get("source") or {}, dict):
        raise UserError(f"report {path} has a malformed source: an object with the trace's path expected, "
                        f"not a {type(report['source']).__name__}")
    return report


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
