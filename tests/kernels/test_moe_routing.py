"""MoE routing (kernels/moe_routing.py): the routed experts forward against transformers' eager experts loop,
forward and every gradient (hidden states, both weight stacks, the routing weights)."""
import types

import pytest
import torch
import torch.nn.functional as F
from kernel_numerics import assert_no_worse, errors

from profiler_svc.kernels._elementwise import SILU
from profiler_svc.kernels.moe_routing import combine, routed_experts, sum_rows
from profiler_svc.kernels.swiglu import experts_gate, experts_loop

TOKENS, HIDDEN, INTER, EXPERTS = 37, 64, 48, 5


def routing(top_k: int, seed: int = 3):
    """Each token's top_k distinct experts; expert EXPERTS - 1 gets no token, so one group is empty."""
    gen = torch.Generator().manual_seed(seed)
    index = torch.stack([torch.randperm(EXPERTS - 1, generator=gen)[:top_k] for _ in range(TOKENS)])
    return index


def inputs64(top_k: int):
    gen = torch.Generator().manual_seed(top_k)
    hidden = torch.randn(TOKENS, HIDDEN, generator=gen, dtype=torch.float64)
    weights = torch.rand(TOKENS, top_k, generator=gen, dtype=torch.float64).softmax(-1)
    gate_up = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, dtype=torch.float64) / HIDDEN**0.5
    down = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, dtype=torch.float64) / INTER**0.5
    return [t.requires_grad_() for t in (hidden, weights, gate_up, down)]


def eager_loop(index):
    """transformers' eager experts forward (the loop, with F.silu(gate) · up), any dtype."""
    def run(hidden, weights, gate_up, down):
        experts = types.SimpleNamespace(num_experts=EXPERTS, gate_up_proj=gate_up, down_proj=down)
        gate = lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]  # noqa: E731
        return experts_loop(experts, hidden, index, weights, gate)
    return run


def ours(index):
    def run(hidden, weights, gate_up, down):
        return routed_experts(hidden, index, weights, gate_up, down, experts_gate(SILU))
    return run


@pytest.mark.parametrize("top_k", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_experts_no_worse_than_the_eager_loop(top_k, dtype):
    index = routing(top_k)
    assert_no_worse(ours(index), {"eager loop": eager_loop(index)}, inputs64(top_k), eager_loop(index), dtype)


def test_routed_experts_match_the_loop_in_float32():
    index = routing(2)
    out, *grads = errors(ours(index), inputs64(2), eager_loop(index), torch.float32)
    assert out[0] < 1e-6 and all(g[0] < 1e-6 for g in grads)  # fp32 against fp64: a few roundings, no more


def test_combine_and_sum_rows_by_hand():
    rows = torch.arange(12, dtype=torch.float32).view(6, 2)  # 3 tokens x 2 experts, rows in expert order
    pos = torch.tensor([[0, 3], [4, 1], [2, 5]])
    weights = torch.tensor([[0.5, 2.0], [1.0, -1.0], [0.25, 0.75]])
    want = torch.stack([0.5 * rows[0] + 2 * rows[3], rows[4] - rows[1], 0.25 * rows[2] + 0.75 * rows[5]])
    torch.testing.assert_close(combine(rows, pos, weights), want, rtol=0, atol=0)
    torch.testing.assert_close(sum_rows(rows, pos), rows[pos].sum(1), rtol=0, atol=0)


def test_training_keeps_only_the_gate_up_output():
    """What the block keeps for its backward, beyond its inputs and parameters: the gate/up projection's output
    ([routed rows, 2I], as Liger's fused MoE) and the routing's integer indices. Not the gathered input rows,
    the activation or the expert rows (together 2·H + I more floats a routed row). In 16-bit: fp32 keeps the
    expert rows for its routing weights' gradient."""
    top_k = 2
    index = routing(top_k)
    leaves = [t.detach().bfloat16().requires_grad_() for t in inputs64(top_k)]
    kept = []

    def pack(t):
        if not any(t.untyped_storage().data_ptr() == leaf.untyped_storage().data_ptr() for leaf in leaves):
            kept.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ours(index)(*leaves).sum().backward()
    floats = sum(t.numel() for t in kept if t.is_floating_point())
    assert floats == TOKENS * top_k * 2 * INTER
    assert all(g is not None for g in (leaf.grad for leaf in leaves))
