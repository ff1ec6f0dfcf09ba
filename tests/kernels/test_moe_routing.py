"""MoE routing (kernels/moe_routing.py): the routed experts forward against transformers' eager experts loop,
forward and every gradient (hidden states, both weight stacks, the routing weights)."""
import types

import pytest
import torch
import torch.nn.functional as F
from kernel_numerics import assert_no_worse, errors

from profiler_svc.kernels._elementwise import SILU
from profiler_svc.kernels.moe_routing import CombineFunction, combine, routed_experts, sum_rows
from profiler_svc.kernels.swiglu import experts_loop, gated_act_split

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
        return routed_experts(hidden, index, weights, gate_up, down, lambda h: gated_act_split(h, SILU))
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


def test_combine_and_its_backward_by_hand():
    rows = torch.arange(12, dtype=torch.float32).view(6, 2)  # 3 tokens x 2 experts, rows in expert order
    pos = torch.tensor([[0, 3], [4, 1], [2, 5]])
    weights = torch.tensor([[0.5, 2.0], [1.0, -1.0], [0.25, 0.75]], requires_grad=True)
    want = torch.stack([0.5 * rows[0] + 2 * rows[3], rows[4] - rows[1], 0.25 * rows[2] + 0.75 * rows[5]])
    torch.testing.assert_close(combine(rows, pos, weights.detach()), want, rtol=0, atol=0)
    torch.testing.assert_close(sum_rows(rows, pos), rows[pos].sum(1), rtol=0, atol=0)
    leaf = rows.clone().requires_grad_()
    dout = torch.tensor([[1.0, -2.0], [0.5, 3.0], [2.0, 1.0]])
    out = CombineFunction.apply(leaf, pos, weights)
    out.backward(dout)
    drows = torch.zeros_like(rows)
    for t in range(3):
        for k in range(2):
            drows[pos[t, k]] = weights[t, k].detach() * dout[t]
    torch.testing.assert_close(leaf.grad, drows, rtol=0, atol=0)
    torch.testing.assert_close(weights.grad, (dout.unsqueeze(1) * rows[pos]).sum(-1), rtol=0, atol=0)
