"""How far the host runs ahead of the GPU through a training step, point by point, without a profiler.

A step the GPU bounds keeps the host ahead: the GPU reaches each point of the step well after the host
enqueued it. Where that lead falls to about zero the GPU sat waiting for the host's launches there. The
profiler cannot show this honestly, since it slows the host it would measure. Here each point records a CUDA
event and the host clock (a few µs each), and the lead is the event's GPU time minus the host time, both on one
clock set at a synchronize (an empty queue, so the first event runs as it is recorded).

Points: the step's start, each decoder layer's forward (a pre-hook), each layer's backward (a hook on the
gradient of its input) and the step's end ("step end": in the bar's step after the optimizer's step and
zero_grad); in the bar's step also the loss and the end of backward. The same points are also timed in steps
started one at a time on an idle GPU (after a synchronize): the host's time to each point there against in the
loop says whether the host runs slower behind a busy GPU, and where.

The model, batch, swaps and loss are ab_end_to_end.py's (the Llama bar's step: `--variant ours --swaps
rope,rms_norm,swiglu --fused-loss`), or with --size a predict_vs_ab.py case's (its model, inputs and step).

    python benchmarks/step_lead.py --out OUT.json [--family llama] [--variant both|ours|eager] [--rounds 2] [--swaps ...]
        [--fused-loss] [--use-cache] [--size balanced|gpu|host --mode train|infer] [--steps 12] [--modules] [--small]
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch

try:
    import ab_end_to_end as e2e  # run as a script
    import predict_vs_ab as pva
    from swap_trace_diff import unprofiled_ms
except ImportError:  # imported as benchmarks.step_lead
    from benchmarks import ab_end_to_end as e2e
    from benchmarks import predict_vs_ab as pva
    from benchmarks.swap_trace_diff import unprofiled_ms

WAITED_MS = 0.05  # a lead under this: the GPU reached the point about as soon as the host enqueued it


class Points:
    """Per step: the CUDA event and host clock its times count from, and (name, CUDA event, host seconds) per
    point."""

    def __init__(self):
        self.steps: list[tuple] = []

    def start(self, origin=None):
        """A new step, timed from ORIGIN (event, host seconds): the loop's, or its own after a synchronize."""
        if origin is None:
            torch.cuda.synchronize()
            origin = (torch.cuda.Event(enable_timing=True), None)
            origin[0].record()
            origin = (origin[0], time.perf_counter())
        self.steps.append((origin, []))
        return origin

    def mark(self, name: str):
        if not self.steps:
            return
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        self.steps[-1][1].append((name, event, time.perf_counter()))


def instrument(model, points: Points, modules: bool = False) -> list:
    """Forward pre-hooks on the decoder layers, and on each layer's input a hook on its gradient; with MODULES,
    also a point before and after the forward of each of a layer's children (its norms, attention, MLP)."""
    handles = []
    for i, layer in enumerate(model.model.layers):
        for name, child in layer.named_children() if modules else ():
            handles.append(child.register_forward_pre_hook(lambda *_, n=f"L{i}.{name}": points.mark(n + " in")))
            handles.append(child.register_forward_hook(lambda *_, n=f"L{i}.{name}": points.mark(n + " out")))
        def pre_hook(_module, args, kwargs, i=i):
            points.mark(f"fwd L{i}")
            hidden = args[0] if args else kwargs.get("hidden_states")
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                hidden.register_hook(lambda grad, i=i: points.mark(f"bwd L{i} done"))
        handles.append(layer.register_forward_pre_hook(pre_hook, with_kwargs=True))
    return handles


def lead_table(steps: list) -> list:
    """Per point, medians over STEPS: ms from its step's start on the host and on the GPU, and the lead (GPU -
    host, both from the step's origin), with how many steps' leads were under WAITED_MS."""
    rows: dict = {}
    for (origin, origin_host), marks in steps:
        host0, gpu0 = (marks[0][2] - origin_host) * 1e3, origin.elapsed_time(marks[0][1])
        for name, event, host in marks:
            host_ms, gpu_ms = (host - origin_host) * 1e3, origin.elapsed_time(event)
            rows.setdefault(name, []).append((host_ms - host0, gpu_ms - gpu0, gpu_ms - host_ms))
    return [{"point": name, "host_ms": round(statistics.median(r[0] for r in vals), 3),
             "gpu_ms": round(statistics.median(r[1] for r in vals), 3),
             "lead_ms": round(statistics.median(r[2] for r in vals), 3),
             "waited": sum(r[2] < WAITED_MS for r in vals), "steps": len(vals)} for name, vals in rows.items()]


def build_step(args, points: Points, state: dict):
    """The model and its step(), marking the step's points; the bar's step takes the fused loss while
    STATE["variant"] is "ours"."""
    if args.size:
        model, _, case_step, tokens = pva.make_case(args.family, args.size, args.mode, smoke=False)

        def step():
            points.mark("step")
            case_step()
            points.mark("step end")
        return model, step, tokens
    model = e2e.build(args.family, args.small, use_cache=args.use_cache)
    ids, labels = e2e.batch(args.family, args.small)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def step():
        points.mark("step")
        loss = e2e.loss_of(model, ids, labels, args.fused_loss and state["variant"] == "ours")
        points.mark("loss")
        loss.backward()
        points.mark("backward end")
        opt.step()
        opt.zero_grad(set_to_none=True)
        points.mark("step end")
    return model, step, "x".join(map(str, ids.shape))


def measure(model, step, points: Points, args) -> dict:
    """One variant's loop: its unmarked step (ms), the marked loop's steps (after the first, which starts on an
    idle GPU) and as many steps started one at a time after a synchronize.

    loop_ms_marked (the GPU's time) and host_enqueue_ms_marked (the host's) are per step over all of the marked
    loop's steps, the first included, which starts from an idle GPU. host_enqueue_ms_marked is the host's wall
    time to the last step's return, so it includes any time the host spent blocked in a sync inside the step."""
    plain_ms = unprofiled_ms(step, steps=args.steps, warmup=3)  # no step started: no marks
    handles = instrument(model, points, args.modules)
    for _ in range(3):  # warm the hooks
        points.start()
        step()
    points.steps = []
    origin = points.start()
    step()
    for _ in range(args.steps - 1):
        points.start(origin)
        step()
    end = torch.cuda.Event(enable_timing=True)
    end.record()
    host_ms = (time.perf_counter() - origin[1]) * 1e3 / args.steps
    torch.cuda.synchronize()
    out = {"loop_ms": plain_ms, "loop_ms_marked": origin[0].elapsed_time(end) / args.steps,
           "host_enqueue_ms_marked": host_ms, "loop": points.steps[1:]}
    points.steps = []
    for _ in range(args.steps):
        points.start()
        step()
    torch.cuda.synchronize()
    out["from_idle"], points.steps = points.steps, []
    for handle in handles:
        handle.remove()
    return out


def run(args) -> dict:
    """Each variant in turn, in one process: eager and ours alternate, the order reversed every other round, the
    swaps applied and taken out again between them (kernels.swap / unswap)."""
    from profiler_svc.kernels import swap, unswap

    points, state = Points(), {"variant": "eager"}
    model, step, tokens = build_step(args, points, state)
    variants = ["eager", "ours"] if args.variant == "both" else [args.variant]
    runs: dict = {v: [] for v in variants}
    swapped: dict = {}
    for round_ in range(args.rounds):
        for variant in variants if round_ % 2 == 0 else variants[::-1]:
            if variant != state["variant"]:
                if variant == "ours":
                    swapped = {}
                    for _, _, name, *_ in swap(model, args.swaps).swapped:
                        swapped[name] = swapped.get(name, 0) + 1
                else:
                    unswap(model)
                state["variant"] = variant
            runs[variant].append(measure(model, step, points, args))
    out = {"family": args.family, "size": args.size or "bar", "mode": args.mode if args.size else "train",
           "tokens": tokens, "swapped": swapped, "fused_loss": bool(args.fused_loss and not args.size),
           "use_cache": args.use_cache if not args.size else "predict_vs_ab's config", "steps": args.steps,
           "rounds": args.rounds, "variants": {}}
    for variant, measured in runs.items():
        out["variants"][variant] = {
            "loop_ms": [round(m["loop_ms"], 3) for m in measured],
            "loop_ms_marked": [round(m["loop_ms_marked"], 3) for m in measured],
            "host_enqueue_ms_marked": [round(m["host_enqueue_ms_marked"], 3) for m in measured],
            "points": lead_table([s for m in measured for s in m["loop"]]),
            "points_from_idle": lead_table([s for m in measured for s in m["from_idle"]])}
    return out


def _bad_arguments(args) -> str | None:
    """What is wrong with the command line, before any model is built; None where nothing is."""
    from profiler_svc import available_swaps

    if set(args.swaps) - set(available_swaps()):
        return f"unknown swap in --swaps (one of {', '.join(available_swaps())})"
    if args.steps < 2 or args.rounds < 1:
        return "--steps takes 2 or more and --rounds 1 or more"
    if not os.access(os.path.dirname(os.path.abspath(args.out)), os.W_OK):  # now, not after the run
        return f"cannot write {args.out}: its folder is missing or not writable"
    return None if torch.cuda.is_available() else "needs a CUDA GPU (it times CUDA events)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--family", default="llama", choices=sorted(set(e2e.FAMILIES) | set(pva.FAMILIES)))
    parser.add_argument("--size", choices=sorted(pva.SIZES), help="a predict_vs_ab case's model, inputs and step")
    parser.add_argument("--mode", default="train", choices=("train", "infer"), help="with --size")
    parser.add_argument("--variant", default="both", choices=("both", "eager", "ours"),
                        help="both: eager and ours alternating in one process")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of the variants (order reversed every other)")
    parser.add_argument("--swaps", type=lambda s: [x for x in s.split(",") if x], default=["rope", "rms_norm", "swiglu"])
    parser.add_argument("--fused-loss", action="store_true")
    parser.add_argument("--use-cache", action="store_true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--modules", action="store_true", help="also time each layer's children's forwards")
    parser.add_argument("--small", action="store_true", help="a tiny config (a smoke test)")
    args = parser.parse_args(argv)
    problem = _bad_arguments(args)
    if problem:
        parser.exit(2, f"step_lead.py: {problem}\n")
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **run(args)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    for variant, res in result["variants"].items():
        print(f"== {variant}: loop {res['loop_ms']} ms, marked {res['loop_ms_marked']} ms, host enqueue "
              f"{res['host_enqueue_ms_marked']} ms a step")
        idle = {row["point"]: row for row in res["points_from_idle"]}
        for row in res["points"]:
            print(f"{row['point']:>16}  host {row['host_ms']:8.3f}  gpu {row['gpu_ms']:8.3f}  lead {row['lead_ms']:8.3f}"
                  f"  waited {row['waited']}/{row['steps']}  from idle: host {idle[row['point']]['host_ms']:8.3f}"
                  f"  lead {idle[row['point']]['lead_ms']:8.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
