"""HTA's load + kernel + idle breakdown with its ProfilerStep lookup made linear, for analysis_vs_hta.py.

    python benchmarks/hta_linear_steps.py TRACE_DIR            # time this in place of stock HTA
    python benchmarks/hta_linear_steps.py --check TRACE_DIR    # same iteration column as HTA's own?

HTA 0.5.0's add_iteration finds each event's ProfilerStep with a Python loop over every step, per event:
O(events x steps). A trace tiled to ~1M events has hundreds of steps (4 per copy), so that loop alone
is most of HTA's time there, while a real 1M-event capture of a few large steps would not pay it. Here the
loop runs once per step over a numpy column instead (the same last-match-wins result), so the comparison
holds without the tiling's help.
"""
import argparse

import numpy as np
import pandas as pd

import hta.common.trace as hta_trace

hta_add_iteration = hta_trace.add_iteration


def add_iteration(df: pd.DataFrame, symbol_table) -> pd.DataFrame:
    """hta.common.trace.add_iteration, with its per-event step scan done per step, vectorized."""
    s_map, s_tab = pd.Series(symbol_table.sym_index), pd.Series(symbol_table.sym_table)
    step_ids = s_map[s_map.index.str.startswith("ProfilerStep")]
    steps = df.loc[df["name"].isin(step_ids.values), ["ts", "dur", "name"]].copy()
    steps["s_name"] = steps["name"].map(lambda i: int(s_tab[i].split("#")[1]))
    steps["iter"] = steps["name"].map(lambda i: s_tab[i])
    ts = df["ts"].to_numpy()
    iteration = np.full(len(ts), -1, dtype=object)  # object, as HTA's apply() gives before to_numeric
    for start, dur, number in zip(steps["ts"], steps["dur"], steps["s_name"]):
        iteration[(start <= ts) & (ts < start + dur)] = number  # a later step wins, as in HTA's loop
    df.loc[df["stream"].lt(0), "iteration"] = pd.Series(iteration, index=df.index)
    df.loc[df["stream"].gt(0), "iteration"] = df["index_correlation"].apply(
        lambda x: df.loc[x, "iteration"] if x > 0 else -1)
    df["iteration"] = pd.to_numeric(df["iteration"], downcast="integer")
    return steps


def check(trace_dir: str) -> None:
    def both(df, symbol_table):
        theirs = df.copy()
        hta_add_iteration(theirs, symbol_table)
        steps = add_iteration(df, symbol_table)
        assert theirs["iteration"].equals(df["iteration"]), "iteration column differs from HTA's"
        print(f"same iteration column as HTA's on {len(df):,} rows, {len(steps)} steps")
        return steps
    hta_trace.add_iteration = both
    from hta.trace_analysis import TraceAnalysis
    TraceAnalysis(trace_dir=trace_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace_dir", help="a folder of rank traces, as HTA reads them")
    parser.add_argument("--check", action="store_true", help="compare the iteration column with HTA's own")
    args = parser.parse_args()
    if args.check:
        return check(args.trace_dir)
    hta_trace.add_iteration = add_iteration
    from hta.trace_analysis import TraceAnalysis
    analyzer = TraceAnalysis(trace_dir=args.trace_dir)
    analyzer.get_gpu_kernel_breakdown(visualize=False)
    analyzer.get_idle_time_breakdown(visualize=False)


if __name__ == "__main__":
    main()
