"""Capture the multi-GPU (NCCL) trace fixtures: one per-rank folder per scenario, with profiler_svc.capture.

Run on a machine with 2 or more GPUs (one process per GPU), from the repository root:

    torchrun --nproc_per_node 2 tests/data/capture_nccl.py OUT_DIR SCENARIO

ACTIVE_STEPS (default 2) sets how many steps are profiled.

SCENARIO is one of:
- ``ddp``: DDP training of a Llama-style model (bf16, fused AdamW), every rank the same work;
- ``ddp_straggler``: as ``ddp``, rank 1 sleeps STRAGGLER_MS (default 20) at the start of every step;
- ``fsdp2``: the same model under FSDP2 (``fully_shard`` per decoder layer and the root);
- ``fsdp2_straggler``: as ``fsdp2``, rank 1 sleeps STRAGGLER_MS at the start of every step;
- ``ddp_hostsync``: as ``ddp``, rank 0 reads the loss (``loss.item()``, a host sync) before backward and then
  spends HOSTSYNC_MS (default 10) on the host, as a logging call would, while the others' NCCL kernels wait.

Every rank logs its loss at the end of a step (``loss.item()``), as a training loop does. The model is built from
a config with random weights (nothing is downloaded). The script does the same on CPUs over gloo (no CUDA), which
is how the tests check that it runs; only the GPU traces are fixtures.
"""
import os
import sys
import time

import torch
import torch.distributed as dist

import profiler_svc

SCENARIOS = ("ddp", "ddp_straggler", "fsdp2", "fsdp2_straggler", "ddp_hostsync")


def active_steps() -> int:
    """ACTIVE_STEPS, the profiled steps (default 2)."""
    value = os.environ.get("ACTIVE_STEPS", "2")
    if not value.isdigit() or int(value) < 1:
        sys.exit(f"ACTIVE_STEPS must be a positive whole number, got {value!r}")
    return int(value)


def build_model(device, dtype):
    import transformers
    on_gpu = device.type == "cuda"
    config = transformers.LlamaConfig(
        vocab_size=32000, hidden_size=1024 if on_gpu else 64, intermediate_size=2816 if on_gpu else 128,
        num_hidden_layers=4 if on_gpu else 2, num_attention_heads=16 if on_gpu else 4,
        num_key_value_heads=8 if on_gpu else 2, max_position_embeddings=4096)
    model = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    return model.to(device, dtype)


def wrap(model, scenario, device):
    if scenario.startswith("fsdp2"):
        from torch.distributed.fsdp import fully_shard
        for layer in model.model.layers:
            fully_shard(layer)
        return fully_shard(model)
    from torch.nn.parallel import DistributedDataParallel as DDP
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: torchrun --nproc_per_node N tests/data/capture_nccl.py OUT_DIR SCENARIO")
    out_dir, scenario = sys.argv[1], sys.argv[2]
    if scenario not in SCENARIOS:
        sys.exit(f"scenario must be one of {', '.join(SCENARIOS)}, got {scenario!r}")
    active = active_steps()
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    model = wrap(build_model(device, dtype), scenario, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = (4, 1024) if on_gpu else (2, 32)
    generator = torch.Generator().manual_seed(rank)  # each rank its own batch, as a sampler gives
    ids = torch.randint(0, 32000, tokens, generator=generator).to(device)
    straggle_s = float(os.environ.get("STRAGGLER_MS", "20")) / 1e3
    host_s = float(os.environ.get("HOSTSYNC_MS", "10")) / 1e3

    def step():
        if scenario.endswith("_straggler") and rank == 1:
            time.sleep(straggle_s)  # the planted straggler: extra host work at the start of each step
        loss = model(input_ids=ids, labels=ids).loss
        if scenario == "ddp_hostsync" and rank == 0:
            loss.item()  # the planted host sync: rank 0 reads the loss before backward...
            time.sleep(host_s)  # ...and logs it, while the other ranks' collectives wait for its backward
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    for _ in range(3):  # compile nothing, but warm cuBLAS, NCCL's communicators and the allocator
        step()
    # 3 steps before the window (wait 2, warmup 1), the profiled ones, 3 after: the step timer's unprofiled steps
    with profiler_svc.capture(model, out_dir, wait=2, warmup=1, active=active, name=f"llama_{scenario}") as cap:
        for _ in range(6 + active):
            step()
            cap.step()
    dist.barrier()
    if rank == 0:
        print("wrote", *sorted(os.listdir(out_dir)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
