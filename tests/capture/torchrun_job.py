"""A two-rank DDP job run by tests/capture under torchrun: each rank captures its own trace."""
import contextlib
import contextvars
import sys
import threading
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn

import profiler_svc

# Each backward stashes a copy of the caller's contextvars in the thread-local state that DDP's gloo allreduce
# works carry, and gloo's worker threads take the GIL to free it once a work is done. A worker still doing so
# as the interpreter shuts down is ended by CPython inside a C++ destructor, which aborts the rank ("terminate
# called without an active exception"; seen in a core dump, torch 2.13); destroy_process_group() does not join
# those threads.
BACKWARD_COPIES = contextvars.ContextVar("backward_copies")


class _Marker:
    """A value that, once the block has ended, only the backward passes' copies of the contextvars hold."""


@contextlib.contextmanager
def backward_copies_freed(timeout=30.0):
    """Wait, as the block ends, until every copy of the contextvars that its backward passes took is freed."""
    marker = _Marker()
    freed = threading.Event()
    weakref.finalize(marker, freed.set)
    token = BACKWARD_COPIES.set(marker)
    del marker
    try:
        yield
    finally:
        BACKWARD_COPIES.reset(token)
    if not freed.wait(timeout):  # waits without the GIL, which the workers need
        raise RuntimeError(f"gloo's workers still hold a backward's state after {timeout:g} s")


dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1)))
x = torch.randn(4, 8)
with backward_copies_freed(), profiler_svc.capture(model, out=sys.argv[1], wait=0, warmup=1, active=1) as cap:
    for _ in range(2):
        model(x).sum().backward()
        cap.step()
print(cap.trace_path)
dist.destroy_process_group()
