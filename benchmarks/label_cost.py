"""Per-module-call host cost of labelling mechanisms, with and without the profiler recording.

A chain of tiny modules (each one small op, or none) is run forward; host time per module call is
reported for: no hooks, no-op hooks, the agent's hooks, and alternative label mechanisms. This is
what decides the capture agent's overhead on host-bound steps.

    python benchmarks/label_cost.py [--device cuda] [--modules 200] [--reps 7]
"""
import argparse
import statistics
import time

import torch

from profiler_svc.agent.hooks import ModuleLabels


class Tiny(torch.nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x):
        return x.add_(1.0) if self.op else x


def chain(n, op):
    # nested in blocks of 4 like a transformer's layers, so labels nest
    blocks = [torch.nn.Sequential(*[Tiny(op) for _ in range(3)]) for _ in range(n // 4)]
    return torch.nn.Sequential(*blocks)


def mechanisms():
    enter = torch._C._autograd._record_function_with_args_enter
    exit_ = torch._C._autograd._record_function_with_args_exit

    def noop(model):
        hs = []
        for m in model.modules():
            hs.append(m.register_forward_pre_hook(lambda mod, a: None))
            hs.append(m.register_forward_hook(lambda mod, a, o: None, always_call=True))
        return lambda: [h.remove() for h in hs]

    def agent(model):
        hooks = ModuleLabels(model, use_nvtx=False)
        hooks.attach()
        return hooks.detach

    def user_annotation_plain(model):
        stack = []
        hs = []
        for name, m in model.named_modules():
            label = f"module::{name} ({type(m).__name__})"
            hs.append(m.register_forward_pre_hook(lambda mod, a, label=label: stack.append(enter(label))))
            hs.append(m.register_forward_hook(lambda mod, a, o: exit_(stack.pop()), always_call=True))
        return lambda: [h.remove() for h in hs]

    def record_function_fast(model):
        fast = torch._C._profiler._RecordFunctionFast
        stack = []
        hs = []
        for name, m in model.named_modules():
            label = f"module::{name} ({type(m).__name__})"

            def pre(mod, a, label=label):
                r = fast(label)
                r.__enter__()
                stack.append(r)
            hs.append(m.register_forward_pre_hook(pre))
            hs.append(m.register_forward_hook(lambda mod, a, o: stack.pop().__exit__(None, None, None), always_call=True))
        return lambda: [h.remove() for h in hs]

    def global_hooks(model):
        labels = {m: f"module::{name} ({type(m).__name__})" for name, m in model.named_modules()}
        stack = []

        def pre(mod, a):
            label = labels.get(mod)
            if label is not None:
                stack.append(enter(label))

        def post(mod, a, o):
            if mod in labels:
                exit_(stack.pop())
        h1 = torch.nn.modules.module.register_module_forward_pre_hook(pre)
        h2 = torch.nn.modules.module.register_module_forward_hook(post, always_call=True)
        return lambda: (h1.remove(), h2.remove())

    return {"none": lambda model: (lambda: None), "noop_hooks": noop, "agent": agent,
            "user_annotation_plain": user_annotation_plain, "record_function_fast": record_function_fast,
            "global_hooks": global_hooks}


def per_call_us(model, x, calls, reps, sync):
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(10):
            model(x)
        if sync:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) / (10 * calls) * 1e6)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--modules", type=int, default=200)
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    x = torch.zeros(16, device=args.device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if args.device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    print(f"{torch.__version__} {args.device} {torch.cuda.get_device_name() if args.device == 'cuda' else ''}")
    print("| mechanism | op | no profiler us/call | profiler us/call |")
    print("| --- | --- | ---: | ---: |")
    for op in (False, True):
        model = chain(args.modules, op).to(args.device)
        calls = sum(1 for _ in model.modules())
        for name, attach in mechanisms().items():
            detach = attach(model)
            try:
                per_call_us(model, x, calls, 2, args.device == "cuda")
                bare = per_call_us(model, x, calls, args.reps, args.device == "cuda")
                with torch.profiler.profile(activities=activities, record_shapes=True):
                    per_call_us(model, x, calls, 2, args.device == "cuda")
                    prof = per_call_us(model, x, calls, args.reps, args.device == "cuda")
            finally:
                detach()
            print(f"| {name} | {'add_' if op else 'none'} | {bare:.2f} | {prof:.2f} |", flush=True)


if __name__ == "__main__":
    main()
