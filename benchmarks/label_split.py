"""Where do a labelled step's extra host milliseconds go? The Llama training step of
capture_overhead.py, with each labelling mechanism attached in turn (rotating order, one step each per
round), under a profiler (CPU+CUDA, record_shapes, a fresh cycle every two rounds) and without one:

  none            nothing attached
  plain_wrappers  every module's forward wrapped by a bound method that only calls the class forward
  ranges_only     those wrappers opening a _RecordFunctionFast label range around the call
  agent           the capture agent's labels (ModuleLabels without NVTX)
  noop_hooks      a no-op forward pre-hook and forward hook on every module (the old mechanism's floor)

    python benchmarks/label_split.py [--rounds 40] [--batch 4 --seq 1024]
"""

import sys
import statistics
import types
import argparse

sys.path.insert(0, ".")
import torch
import capture_overhead as C
from profiler_svc.agent.hooks import ModuleLabels, LABEL_RANGE
from profiler_svc.trace.labels import module_label

p = argparse.ArgumentParser()
for k, v in dict(hidden=2048, intermediate=5632, layers=8, heads=16, kv_heads=8, batch=4, seq=1024, rounds=30).items():
    p.add_argument("--" + k.replace("_", "-"), type=int, default=v)
p.add_argument("--device", default="cuda")
args = p.parse_args()
model, step = C.build(args)


def plain_wrappers(model):
    done = []
    for m in model.modules():
        cf = type(m).forward

        def fwd(self, *a, __cf=cf, **k):
            return __cf(self, *a, **k)

        vars(m)["forward"] = types.MethodType(fwd, m)
        done.append(m)
    return lambda: [vars(m).pop("forward") for m in done]


def ranges_only(model):  # a label range per module call, opened by the wrapper: the agent minus its checks
    mk, ent, ex = LABEL_RANGE
    done = []
    for name, m in model.named_modules():
        cf, label = type(m).forward, module_label(name, type(m).__name__)

        def fwd(self, *a, __cf=cf, __label=label, **k):
            r = mk(__label)
            ent(r)
            try:
                return __cf(self, *a, **k)
            finally:
                ex(r, None, None, None)

        vars(m)["forward"] = types.MethodType(fwd, m)
        done.append(m)
    return lambda: [vars(m).pop("forward") for m in done]


def agent(model):
    h = ModuleLabels(model, use_nvtx=False)
    h.attach()
    return h.detach


def noop_hooks(model):
    hs = []
    for m in model.modules():
        hs.append(m.register_forward_pre_hook(lambda mod, a: None))
        hs.append(m.register_forward_hook(lambda mod, a, o: None, always_call=True))
    return lambda: [h.remove() for h in hs]


variants = {
    "none": lambda m: lambda: None,
    "plain_wrappers": plain_wrappers,
    "ranges_only": ranges_only,
    "agent": agent,
    "noop_hooks": noop_hooks,
}
for _ in range(3):
    step()
for profiled in (True, False):
    samples = {k: [] for k in variants}
    prof = (
        torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
            record_shapes=True,
            schedule=torch.profiler.schedule(wait=0, warmup=0, active=2 * len(variants)),
            on_trace_ready=lambda p: None,
        )
        if profiled
        else None
    )  # a fresh cycle every two rounds
    if prof:
        prof.__enter__()
    for r in range(args.rounds):
        for name, attach in list(variants.items()) if r % 2 else list(variants.items())[::-1]:
            undo = attach(model)
            samples[name].append(C.timed(step))
            undo()
            if prof:
                prof.step()
    if prof:
        prof.__exit__(None, None, None)
    base_h = statistics.median(h for h, _ in samples["none"])
    base_w = statistics.median(w for _, w in samples["none"])
    print(f"{'profiler' if profiled else 'no profiler'} (medians of {args.rounds} steps each):")
    for name, s in samples.items():
        h = statistics.median(x for x, _ in s)
        w = statistics.median(x for _, x in s)
        print(f"  {name:15s} host {h:7.2f} ms ({h - base_h:+.2f})  step {w:7.2f} ms ({w - base_w:+.2f})", flush=True)
