"""Where the steps of a trace begin and end.

In order of trust: the profiler's own `ProfilerStep#N` ranges (a schedule, or `profiler_svc.capture`, which
writes them also without one); else each call of the model's root module (capture's labels); else the
whole window as one step.
"""
import numpy as np
import pandas as pd

from . import labels
from .kernel_names import name_mask

STEP_PREFIX = "ProfilerStep#"
COLUMNS = ["name", "ts", "dur", "end", "thread"]


def find_steps(cpu: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """(steps in time order with COLUMNS, how they were found: "profiler", "root module" or "none")."""
    if not len(cpu):
        return pd.DataFrame(columns=COLUMNS), "none"
    marked = name_mask(cpu, lambda n: n.startswith(STEP_PREFIX)) & name_mask(cpu, lambda c: c == "user_annotation", "cat")
    if marked.any():
        return _sorted(cpu[marked]), "profiler"
    root = name_mask(cpu, lambda n: n.startswith(labels.MODULE_PREFIX + labels.ROOT_NAME + " ("))
    if root.sum() >= 2:
        return _root_calls(cpu[root]), "root module"
    return pd.DataFrame(columns=COLUMNS), "none"


def _sorted(rows: pd.DataFrame) -> pd.DataFrame:
    return rows[COLUMNS].sort_values("ts").reset_index(drop=True)


def _root_calls(roots: pd.DataFrame) -> pd.DataFrame:
    """A step from one root-module call to the next (the backward and optimizer that follow a training
    forward belong to its step); the last ends with its call."""
    roots = _sorted(roots)
    # nested root calls (a wrapper calling the model) are one call
    outer = roots["ts"].to_numpy() >= np.maximum.accumulate(np.r_[-np.inf, roots["end"].to_numpy()[:-1]])
    roots = roots[outer].reset_index(drop=True)
    ends = np.r_[roots["ts"].to_numpy()[1:], roots["end"].to_numpy()[-1]]
    steps = roots.assign(end=ends, dur=ends - roots["ts"].to_numpy(),
                         name=[f"step {i}" for i in range(len(roots))])
    return steps[COLUMNS]
