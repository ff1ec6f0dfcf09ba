"""Host µs to enqueue one RMSNorm call, started on an idle GPU (as benchmarks/host_costs.py and capture's
host-alone steps time it) and behind ~10 ms of queued GPU work (as a GPU-bound step's host runs).

    python benchmarks/host_enqueue_busy.py --out OUT.json [--calls 60]

HF's LlamaRMSNorm (eager) against the rms_norm swap, on its default dispatch and forced onto its Triton kernel
(NATIVE_BELOW = 0), at 8, 512 and 4096 rows of 2048, bf16: forward, and forward + backward
(torch.autograd.grad over the input and the weight). Each figure is the median of CALLS calls.
"""
import argparse
import json
import statistics
from contextlib import nullcontext

import torch

try:
    from host_costs import host_samples, native_dispatch_off  # run as a script
except ImportError:  # imported as benchmarks.host_enqueue_busy
    from benchmarks.host_costs import host_samples, native_dispatch_off

ROWS = (8, 512, 4096)
HIDDEN = 2048


def host_us(step, busy: bool, calls: int) -> float:
    """Median host µs of step(), each call started after a synchronize and, with BUSY, behind a queued sleep."""
    def wait():
        torch.cuda.synchronize()
        if busy:
            torch.cuda._sleep(20_000_000)  # ~10 ms of GPU work ahead of the call's kernels

    return round(statistics.median(host_samples(step, calls, warmup=5, sync=wait)) * 1e6, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--calls", type=int, default=60)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.exit(2, "host_enqueue_busy.py: needs a CUDA GPU\n")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from profiler_svc.kernels.rms_norm import RMSNorm
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "calls": args.calls, "us": {}}
    for label in ("", "_triton"):
        with native_dispatch_off() if label else nullcontext():
            for rows in ROWS:
                x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                grad = torch.randn_like(x)
                modules = {"ours": RMSNorm(HIDDEN)} if label else {"eager": LlamaRMSNorm(HIDDEN), "ours": RMSNorm(HIDDEN)}
                for name, module in modules.items():
                    module = module.cuda().to(torch.bfloat16)
                    forward = lambda m=module: m(x)  # noqa: E731
                    both = lambda m=module: torch.autograd.grad(m(x), (x, m.weight), grad)  # noqa: E731
                    figures = {f"{what} {state}": host_us(step, state == "busy", args.calls)
                               for what, step in (("fwd", forward), ("fwd+bwd", both)) for state in ("idle", "busy")}
                    out["us"][f"{name}{label} rows {rows}"] = figures
                    print(f"{name}{label} rows {rows}", figures, flush=True)
    try:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    except OSError as err:
        parser.exit(2, f"host_enqueue_busy.py: cannot write {args.out}: {err.strerror}\n")


if __name__ == "__main__":
    main()
