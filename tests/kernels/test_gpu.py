"""On a GPU: each op at a realistic size, error vs fp64 no worse than eager's and torch.compile's, and
torch.compile(fullgraph=True) with Inductor through our ops. Skipped without CUDA (CI has none)."""
import importlib

import pytest
import torch
import torch.nn.functional as F
from kernel_numerics import errors

from profiler_svc import kernels as K

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def hf_rms_norm(x, w):
    h = x.float()
    return w * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype)


CASES = {
    "rms_norm": (lambda x, w: K.rms_norm(x, w, 1e-6), hf_rms_norm,
                 lambda x, w: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w),
    "layer_norm": (lambda x, w: K.layer_norm(x, w, None, 1e-5), lambda x, w: F.layer_norm(x, x.shape[-1:], w, None, 1e-5),
                   lambda x, w: F.layer_norm(x, x.shape[-1:], w, None, 1e-5)),
    "softmax": (lambda x, w: K.softmax(x * w), lambda x, w: torch.softmax((x * w).float(), -1).to(x.dtype),
                lambda x, w: torch.softmax(x * w, -1)),
}


def compiled(name, eager):
    """torch.compile of the eager baseline. Softmax's `x * w` only gives w a gradient: it is rounded to
    the dtype before the op, in ours and eager alike, so only the softmax is compiled (compiled whole,
    Inductor fuses the product into it and skips that rounding: a different computation, not a better
    softmax)."""
    if name != "softmax":
        return torch.compile(eager, dynamic=False)
    softmax = torch.compile(lambda h: torch.softmax(h.float(), -1).to(h.dtype), dynamic=False)
    return lambda x, w: softmax(x * w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("n", [5000, 20000, 70000])  # 20000: softmax's 16-bit whole-row (int32 pairs) backward
def test_no_worse_than_eager_and_compile(name, dtype, n):
    ours, eager, reference = CASES[name]
    gen = torch.Generator(device="cuda").manual_seed(n)
    # 1024 rows: above the 16-bit native-dispatch size (2^22 elements) at every width, so our kernels run
    x = (2 * torch.randn(1024, n, device="cuda", dtype=torch.float64, generator=gen)).requires_grad_()
    w = (1 + 0.1 * torch.randn(n, device="cuda", dtype=torch.float64, generator=gen)).requires_grad_()
    mine = errors(ours, [x, w], reference, dtype)
    for fn in (eager, compiled(name, eager)):
        theirs = errors(fn, [x, w], reference, dtype)
        for (e, _), (t, _) in zip(mine, theirs):
            assert e <= 1.1 * t + 1e-7


def test_fullgraph_inductor_matches_eager():
    rows = 4608  # x 1000 columns: above the 16-bit native-dispatch size, so eager runs our kernels too
    x = torch.randn(rows, 1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 1000, (rows,), device="cuda")

    def step(x, w):
        h, s = K.rms_norm(x, w, 1e-6, residual=x * 2)
        h = K.layer_norm(h + s, w, w * 0.5, 1e-5)
        return K.cross_entropy(K.softmax(h) * 10, t, label_smoothing=0.1) + K.fused_linear_cross_entropy(
            h, (w[:, None] * w[None, :]).contiguous(), t)

    torch._dynamo.reset()
    compiled = torch.compile(step, fullgraph=True)
    out, ref = compiled(x, w), step(x, w)
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)
    for g, r in zip(torch.autograd.grad(out, [x, w]), torch.autograd.grad(ref, [x, w])):
        torch.testing.assert_close(g, r, rtol=2e-2, atol=2e-2)


def test_fullgraph_softmax_widths(monkeypatch):
    """torch.compile(fullgraph=True) through each of softmax's kernels: whole rows, the 16-bit whole-row
    backward on int32 pairs (20000 columns), its odd-width fallback, and the two-pass wide rows."""
    # eager ours at these small sizes too, not torch.softmax (compiled, the op never hands off)
    monkeypatch.setattr(importlib.import_module("profiler_svc.kernels.softmax"), "NATIVE_BELOW", 0)
    for n in (1000, 20000, 20001, 70000):
        torch._dynamo.reset()  # static shapes: the ops take concrete widths (see docs/kernels.md)
        compiled = torch.compile(lambda x: K.softmax(x), fullgraph=True, dynamic=False)
        x = torch.randn(64, n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(64, n, device="cuda", dtype=torch.bfloat16)
        out, ref = compiled(x), K.softmax(x)
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        (g,), (r,) = torch.autograd.grad(out, x, dy), torch.autograd.grad(ref, x, dy)
        torch.testing.assert_close(g, r, rtol=0, atol=0)


@pytest.mark.parametrize("approximate", [None, "tanh", "none"])
def test_small_gated_calls_are_eagers_ops_and_large_ones_our_kernel(approximate):
    """Below NATIVE_BELOW elements a 16-bit gated call runs eager's act(gate) * up: bitwise eager's output
    and gradients, no Triton launch. Above, our kernel: one rounding, so not bitwise eager's."""
    swiglu_module = importlib.import_module("profiler_svc.kernels.swiglu")  # the package's `swiglu` is the op

    def eager(gate, up):
        return (F.silu(gate) if approximate is None else F.gelu(gate, approximate=approximate)) * up

    def ours(gate, up):
        return K.swiglu(gate, up) if approximate is None else K.geglu(gate, up, approximate)

    for rows, small in ((256, True), (2048, False)):
        gen = torch.Generator(device="cuda").manual_seed(rows)
        gate, up = (torch.randn(rows, 5632, device="cuda", generator=gen).bfloat16().requires_grad_() for _ in range(2))
        assert (gate.numel() < swiglu_module.NATIVE_BELOW) == small
        dy = torch.randn(rows, 5632, device="cuda", generator=gen).bfloat16()
        got, want = ours(gate, up), eager(gate, up)
        grads = torch.autograd.grad(got, [gate, up], dy), torch.autograd.grad(want, [gate, up], dy)
        same = torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(*grads))
        assert same == small
        if approximate is None:  # Phi-3's fused gate_up, through the split entry point
            with torch.no_grad():
                split = swiglu_module.gated_act_split(torch.cat([gate, up], -1), swiglu_module.SILU)
                assert torch.equal(split, F.silu(gate) * up) == small


NATIVE_OPS = {  # op -> (ours, torch's op its small calls go to, second input), on x of [rows, width]
    "layer_norm": (lambda x, w: K.layer_norm(x, w, w, 1e-5), lambda x, w: F.layer_norm(x, x.shape[-1:], w, w, 1e-5),
                   "weight"),
    "softmax": (lambda x, _: K.softmax(x), lambda x, _: torch.softmax(x, -1), None),
    "cross_entropy": (K.cross_entropy, lambda x, t: F.cross_entropy(x.float(), t), "target"),
    "gelu_tanh": (lambda x, _: K.gelu_tanh(x), lambda x, _: F.gelu(x, approximate="tanh"), None),
}


@pytest.mark.parametrize("op", sorted(NATIVE_OPS))
def test_small_calls_take_torchs_op_and_large_ones_our_kernel(op):
    """Below NATIVE_BELOW elements a 16-bit call runs torch's own op: bitwise its output and gradient, and no
    Triton launch. Above, our kernel launches."""
    from triton import knobs

    module = importlib.import_module(f"profiler_svc.kernels.{op}")  # the package's attribute is the op
    ours, native, second = NATIVE_OPS[op]
    width = 32000 if op == "cross_entropy" else 2048
    for rows in (64, 4096):
        small = rows * width < module.NATIVE_BELOW
        assert small == (rows == 64)
        gen = torch.Generator(device="cuda").manual_seed(rows)
        x = (3 * torch.randn(rows, width, device="cuda", generator=gen)).bfloat16().requires_grad_()
        other = {"weight": lambda: (1 + 0.1 * torch.randn(width, device="cuda", generator=gen)).bfloat16(),
                 "target": lambda: torch.randint(0, width, (rows,), device="cuda", generator=gen),
                 None: lambda: None}[second]()
        seen = []
        hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731  (a LazyDict)
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            got = ours(x, other)
            (grad,) = torch.autograd.grad(got, x, torch.ones_like(got))
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        want = native(x, other)
        (want_grad,) = torch.autograd.grad(want, x, torch.ones_like(want))
        assert bool(seen) != small
        assert got.dtype == want.dtype
        if small:
            assert torch.equal(got, want) and torch.equal(grad, want_grad)
        else:
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_a_small_cross_entropy_call_with_int32_targets_runs_our_kernel():
    """Our checks take int32 class indices, which F.cross_entropy rejects: a small 16-bit call with them runs our
    kernel (before, it reached torch's op and failed there), and matches torch on the same indices as int64."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = (3 * torch.randn(64, 32000, device="cuda", generator=gen)).bfloat16().requires_grad_()
    target = torch.randint(0, 32000, (64,), device="cuda", generator=gen)
    target[3] = -100
    got = K.cross_entropy(x, target.int())
    (grad,) = torch.autograd.grad(got, x)
    want = F.cross_entropy(x.float(), target)
    (want_grad,) = torch.autograd.grad(want, x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grad, want_grad)


def test_small_gemma_norms_take_torchs_fused_op_in_fp32_and_stay_as_accurate():
    """Below NATIVE_BELOW_OFFSET elements a 16-bit Gemma (1 + w) norm runs F.rms_norm on fp32 copies (bitwise
    that path's output and gradients); above, our kernel. Both paths' errors against fp64 stay within 1.1x
    of Gemma's eager module's."""
    rms_norm_module = importlib.import_module("profiler_svc.kernels.rms_norm")  # the package's `rms_norm` is the op

    def gemma_eager(x, w):  # transformers' GemmaRMSNorm.forward
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())).type_as(x)

    def native(x, w):
        return F.rms_norm(x.float(), x.shape[-1:], w.float() + 1, 1e-6).to(x.dtype)

    def ours(x, w):
        return K.rms_norm(x, w, 1e-6, offset=1.0)

    def reference(x, w):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)

    for rows, small in ((256, True), (4096, False)):
        gen = torch.Generator(device="cuda").manual_seed(rows)
        x64 = torch.randn(rows, 2048, device="cuda", dtype=torch.float64, generator=gen).requires_grad_()
        w64 = (0.1 * torch.randn(2048, device="cuda", dtype=torch.float64, generator=gen)).requires_grad_()
        assert (x64.numel() < rms_norm_module.NATIVE_BELOW_OFFSET) == small
        x, w = (t.detach().bfloat16().requires_grad_() for t in (x64, w64))
        dy = torch.randn(rows, 2048, device="cuda", generator=gen).bfloat16()
        got, want = ours(x, w), native(x, w)
        grads = torch.autograd.grad(got, [x, w], dy), torch.autograd.grad(want, [x, w], dy)
        assert (torch.equal(got, want) and all(torch.equal(a, b) for a, b in zip(*grads))) == small
        for (e, _), (t, _) in zip(errors(ours, [x64, w64], reference, torch.bfloat16),
                                  errors(gemma_eager, [x64, w64], reference, torch.bfloat16)):
            assert e <= 1.1 * t + 1e-7


def test_fast_launches_respecialize_on_alignment_and_hand_hooked_launches_to_triton():
    """launch() skips Triton's launch path after a kernel's first launch; a misaligned input (16-byte
    alignment is part of Triton's specialization) must get its own compiled kernel and the same results,
    and a launch hook must see every launch."""
    from triton import knobs

    from profiler_svc.kernels import _launch

    gen = torch.Generator(device="cuda").manual_seed(0)
    flat = torch.randn(4096 * 2048 + 1, device="cuda", generator=gen).bfloat16()
    w = (1 + 0.1 * torch.randn(2048, device="cuda", generator=gen)).bfloat16()
    aligned, misaligned = flat[:-1].view(4096, 2048), flat[1:].view(4096, 2048)  # above the native-dispatch size
    assert misaligned.data_ptr() % 16 and not aligned.data_ptr() % 16
    for x in (aligned, misaligned, aligned, misaligned):  # a clone is aligned: the other specialization's math
        assert torch.equal(K.rms_norm(x, w, 1e-6), K.rms_norm(x.clone(), w, 1e-6))
    keys = [key for key, entry in _launch._COMPILED.items() if entry and key[0].__name__ == "_norm_fwd_kernel"]
    assert {key[3][1] for key in keys} >= {True, False}  # x's alignment: two specializations
    first = K.rms_norm(misaligned, w, 1e-6)
    assert torch.equal(first, K.rms_norm(misaligned, w, 1e-6))
    seen = []
    hook = lambda metadata: seen.append(metadata.get()["name"])  # noqa: E731  (a LazyDict)
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        assert torch.equal(K.rms_norm(misaligned, w, 1e-6), first)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert seen == ["_norm_fwd_kernel"]


def test_routed_experts_no_worse_than_transformers_grouped_mm_path():
    """Mixtral-sized experts (8 of 2816, top 2, 4096 tokens, bf16): moe_routing's routed grouped GEMMs against
    transformers' grouped_mm experts function, forward and every gradient, both against the fp64 eager loop."""
    import types

    moe = pytest.importorskip("transformers.integrations.moe")
    from profiler_svc.kernels.moe_routing import routed_experts
    from profiler_svc.kernels.swiglu import SILU, experts_gate, experts_loop

    tokens, hidden, inter, experts = 4096, 2048, 2816, 8
    gen = torch.Generator(device="cuda").manual_seed(0)
    index = torch.rand(tokens, experts, device="cuda", generator=gen).topk(2, dim=-1).indices
    leaves = [torch.randn(tokens, hidden, device="cuda", dtype=torch.float64, generator=gen),
              torch.rand(tokens, 2, device="cuda", dtype=torch.float64, generator=gen).softmax(-1),
              torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.float64, generator=gen) / hidden**0.5,
              torch.randn(experts, hidden, inter, device="cuda", dtype=torch.float64, generator=gen) / inter**0.5]
    leaves = [t.requires_grad_() for t in leaves]

    def block(gate_up, down):
        return types.SimpleNamespace(num_experts=experts, gate_up_proj=gate_up, down_proj=down, has_gate=True,
                                     has_bias=False, is_transposed=False, has_post_expert_norm=False,
                                     _is_expert_parallel=False,
                                     _apply_gate=lambda h: F.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1])

    def transformers_grouped_mm(x, w, gate_up, down):
        return moe.grouped_mm_experts_forward(block(gate_up, down), x, index, w.float())

    def reference(x, w, gate_up, down):
        b = block(gate_up, down)
        return experts_loop(b, x, index, w, b._apply_gate)

    def ours(x, w, gate_up, down):
        return routed_experts(x, index, w.float(), gate_up, down, experts_gate(SILU))

    mine = errors(ours, leaves, reference, torch.bfloat16)
    theirs = errors(transformers_grouped_mm, leaves, reference, torch.bfloat16)
    for (e, _), (t, _) in zip(mine, theirs):
        assert e <= 1.1 * t + 1e-7


def test_norm_outputs_recomputed_free_their_memory_and_keep_the_bits():
    """At the Llama bar's size (8192 x 2048 bf16) a norm output saved by two projections (as the attention's
    q/k/v and the MLP's gate/up save theirs) is freed after the forward and computed again in the backward:
    the graph holds 33.5 MB less, and every gradient is bit-identical to keeping it."""
    from torch import nn

    from profiler_svc.kernels import _norm, placement
    torch.manual_seed(0)
    x = torch.randn(4, 2048, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.ones(2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gate, up = (nn.Linear(2048, 5632, bias=False, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    params = [x, w, gate.weight, up.weight]
    held, grads = {}, {}
    for recipe in (False, True):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        y = K.rms_norm(x * 1.0, w)
        assert x.numel() >= placement.RECOMPUTE_NORM_OUTPUT_MIN
        with _norm.saved_as_recipe(y) if recipe else torch.enable_grad():
            out = (gate(y).float() * up(y).float()).mean()
        del y
        torch.cuda.synchronize()
        held[recipe] = torch.cuda.memory_allocated() - before
        grads[recipe] = torch.autograd.grad(out, params)
        del out
    assert held[False] - held[True] == x.numel() * 2
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
