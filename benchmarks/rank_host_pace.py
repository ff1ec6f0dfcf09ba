"""Does a rank's host run slower than its peer's only under the profiler? Each rank times its own host work per
step (forward, backward and optimizer calls; no sync inside) in unprofiled steps and in steps profiled by
profiler_svc.capture, alternately, in one process per GPU (DDP, the model of tests/data/capture_nccl.py).

    torchrun --nproc_per_node 2 benchmarks/rank_host_pace.py OUT_DIR [ROUNDS]

Writes OUT_DIR/host_pace_rank{R}.json: per round, the unprofiled and profiled host times per step (µs).
"""
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import profiler_svc
from tests.data.capture_nccl import build_model, wrap

STEPS = 8  # unprofiled steps timed per round; the profiled window holds as many


def main():
    if len(sys.argv) not in (2, 3) or (len(sys.argv) == 3 and not (sys.argv[2].isdigit() and int(sys.argv[2]) > 0)):
        sys.exit("usage: torchrun --nproc_per_node 2 benchmarks/rank_host_pace.py OUT_DIR [ROUNDS > 0]")
    out_dir = sys.argv[1]
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = wrap(build_model(device, torch.bfloat16), "ddp", device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids = torch.randint(0, 32000, (4, 1024), generator=torch.Generator().manual_seed(rank)).to(device)

    def step() -> float:
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        host = time.perf_counter() - t0
        loss.item()  # the loop's own end-of-step read, outside the timed host work
        return host * 1e6

    for _ in range(3):
        step()
    results = []
    with tempfile.TemporaryDirectory() as traces:
        for r in range(rounds):
            plain = [step() for _ in range(STEPS)]
            profiled = []
            with profiler_svc.capture(model, traces, wait=0, warmup=1, active=STEPS, name=f"pace{r}") as cap:
                for i in range(STEPS + 1):
                    us = step()
                    if i:  # the warm-up step is not recorded
                        profiled.append(us)
                    cap.step()
            results.append({"unprofiled_us": plain, "profiled_us": profiled,
                            "unprofiled_median_us": statistics.median(plain),
                            "profiled_median_us": statistics.median(profiled)})
            dist.barrier()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"host_pace_rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                   "rounds": results}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
