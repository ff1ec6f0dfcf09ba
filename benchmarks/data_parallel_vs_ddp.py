"""The same training step under torch.nn.DataParallel (one process, two GPUs) and DistributedDataParallel (one
process a GPU, NCCL): what the analyser would have to predict for a "use DDP" fix.

    python benchmarks/data_parallel_vs_ddp.py --out FILE.json [--steps 20] [--warmup 5]

Model: the agent fixture `llama_bf16_data_parallel_train`'s (transformers LlamaForCausalLM, 2 layers, hidden 1024,
bf16, SDPA), 8x512 tokens a step in all (4x512 a GPU), AdamW (foreach). Each variant: warm-up steps, then CUDA
events around each timed step on every GPU it uses (the step ends when the slowest GPU does); the median is reported
with the min and max. Needs two GPUs.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "data", "agent"))
from capture_agent_fixture import LLAMA, _build  # noqa: E402

TOKENS = (8, 512)


def _timed(step, devices, steps, warmup):
    """ms of each timed step: from the step's start to the end of its last GPU's work."""
    for _ in range(warmup):
        step()
    for d in devices:
        torch.cuda.synchronize(d)
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        for d in devices:
            torch.cuda.synchronize(d)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def data_parallel(steps, warmup):
    model = torch.nn.DataParallel(_build("LlamaForCausalLM", "LlamaConfig", LLAMA, "sdpa", torch.bfloat16),
                                  device_ids=[0, 1])
    ids = torch.randint(0, LLAMA["vocab_size"], TOKENS, device="cuda:0")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step():
        model(input_ids=ids, labels=ids).loss.mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _timed(step, [0, 1], steps, warmup)


def _ddp_rank(rank, steps, warmup, queue):
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    torch.manual_seed(0)
    import capture_agent_fixture
    capture_agent_fixture.DEVICE = f"cuda:{rank}"
    model = torch.nn.parallel.DistributedDataParallel(
        _build("LlamaForCausalLM", "LlamaConfig", LLAMA, "sdpa", torch.bfloat16), device_ids=[rank])
    ids = torch.randint(0, LLAMA["vocab_size"], (TOKENS[0] // 2, TOKENS[1]), device=f"cuda:{rank}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    times = _timed(step, [rank], steps, warmup)
    dist.barrier()
    queue.put((rank, times))
    dist.destroy_process_group()


def ddp(steps, warmup):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_ddp_rank, args=(r, steps, warmup, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join()
    # a DDP step ends when both ranks' do (the gradients' all-reduce couples them): the slower rank's time
    return [max(a, b) for a, b in zip(got[0], got[1])]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if torch.cuda.device_count() < 2:
        sys.exit("needs two GPUs")
    result = {"gpus": [torch.cuda.get_device_name(i) for i in range(2)], "torch": torch.__version__,
              "tokens": list(TOKENS), "steps": args.steps, "warmup": args.warmup}
    for name, run in (("data_parallel", data_parallel), ("ddp", ddp)):
        times = run(args.steps, args.warmup)
        result[name] = {"median_ms": round(statistics.median(times), 2), "min_ms": round(min(times), 2),
                        "max_ms": round(max(times), 2), "steps_ms": [round(t, 2) for t in times]}
        print(name, result[name]["median_ms"], "ms", flush=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
