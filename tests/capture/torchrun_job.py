"""A two-rank DDP job run by tests/capture under torchrun: each rank captures its own trace."""
import sys

import torch
import torch.distributed as dist
import torch.nn as nn

import profiler_svc

dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
x = torch.randn(4, 8)
with profiler_svc.capture(model, out=sys.argv[1], wait=0, warmup=1, active=1) as cap:
    for _ in range(2):
        model(x).sum().backward()
        cap.step()
print(cap.trace_path)
dist.destroy_process_group()
