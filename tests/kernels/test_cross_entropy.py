import importlib

import pytest
import torch
import torch.nn.functional as F
from kernel_numerics import SLACK, assert_no_worse, errors, rel_err
from torch import nn

from profiler_svc.kernels import cross_entropy, fused_linear_cross_entropy, swap, unswap
from profiler_svc.kernels.cross_entropy import CrossEntropyLoss



def problem(m, v, seed, ignore_every=5):
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(m, v, generator=gen, dtype=torch.float64)).requires_grad_()
    target = torch.randint(0, v, (m,), generator=gen)
    target[::ignore_every] = -100
    return logits, target


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction,smoothing", [("mean", 0.1), ("sum", 0.0), ("none", 0.2)])
@pytest.mark.parametrize("m,v", [(37, 1000), (16, 9000)])  # 9000: several chunks of the online pass
def test_numerics_no_worse_than_eager(dtype, reduction, smoothing, m, v):
    logits, target = problem(m, v, seed=v)

    def call(fn):
        return lambda x: fn(x, target, ignore_index=-100, reduction=reduction, label_smoothing=smoothing)

    eager = {"F.cross_entropy": call(F.cross_entropy), "float-upcast": lambda x: call(F.cross_entropy)(x.float()).to(x.dtype)}
    assert_no_worse(call(cross_entropy), eager, [logits], call(F.cross_entropy), dtype)


def test_edge_cases():
    logits, target = problem(6, 50, seed=1)
    x = logits.detach().float()
    target[:] = -100
    assert torch.isnan(cross_entropy(x, target)) and torch.isnan(F.cross_entropy(x, target))  # 0/0, as eager
    assert cross_entropy(x, target, reduction="sum") == 0
    # Class dim 1 and extra dims, as F.cross_entropy takes them; a non-contiguous view.
    gen = torch.Generator().manual_seed(2)
    x3 = torch.randn(2, 7, 5, generator=gen)
    t3 = torch.randint(0, 7, (2, 5), generator=gen)
    torch.testing.assert_close(cross_entropy(x3, t3, reduction="none"), F.cross_entropy(x3, t3, reduction="none"))
    xt = torch.randn(30, 4, generator=gen).t()
    t = torch.randint(0, 30, (4,), generator=gen)
    torch.testing.assert_close(cross_entropy(xt, t), F.cross_entropy(xt, t))
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(x, target, reduction="avg")
    with pytest.raises(ValueError, match="class indices"):
        cross_entropy(x, x)


@pytest.mark.parametrize("reduction,smoothing", [("mean", 0.0), ("sum", 0.2), ("none", 0.0)])
@pytest.mark.parametrize("with_bias,low_memory", [(False, False), (True, False), (True, True)])
def test_fused_linear_cross_entropy_matches_unfused(reduction, smoothing, with_bias, low_memory):
    gen = torch.Generator().manual_seed(3)
    m, h, v = 45, 24, 300
    hidden = torch.randn(m, h, generator=gen, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(v, h, generator=gen, dtype=torch.float64) / h**0.5).requires_grad_()
    bias = torch.randn(v, generator=gen, dtype=torch.float64).requires_grad_() if with_bias else None
    target = torch.randint(0, v, (m,), generator=gen)
    target[::4] = -100
    kwargs = dict(ignore_index=-100, reduction=reduction, label_smoothing=smoothing)
    ref = F.cross_entropy(F.linear(hidden, weight, bias), target, **kwargs)
    leaves = [t for t in (hidden, weight, bias) if t is not None]
    dy = torch.randn(ref.shape, generator=gen, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, leaves, dy)

    ours_leaves = [t.detach().float().requires_grad_() for t in leaves]
    h32, w32 = ours_leaves[:2]
    b32 = ours_leaves[2] if with_bias else None
    # 7 rows per chunk: several chunks and a ragged last one.
    loss = fused_linear_cross_entropy(h32, w32, target, b32, chunk_rows=7, low_memory=low_memory, **kwargs)
    grads = torch.autograd.grad(loss, ours_leaves, dy.float())
    assert rel_err(loss, ref) < 1e-6
    for g, r in zip(grads, ref_grads):
        assert rel_err(g, r) < 1e-5


def test_fused_linear_cross_entropy_bf16_no_worse_than_unfused_eager():
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(3, 11, 32, generator=gen, dtype=torch.float64).requires_grad_()
    weight = (torch.randn(500, 32, generator=gen, dtype=torch.float64) / 32**0.5).requires_grad_()
    target = torch.randint(0, 500, (3, 11), generator=gen)

    def reference(h, w):
        return F.cross_entropy(F.linear(h, w).flatten(0, 1), target.flatten())

    eager = {"hf": lambda h, w: F.cross_entropy(F.linear(h, w).float().flatten(0, 1), target.flatten()).to(h.dtype)}
    ours = lambda h, w: fused_linear_cross_entropy(h, w, target, chunk_rows=8)  # noqa: E731
    assert_no_worse(ours, eager, [hidden, weight], reference, torch.bfloat16)

    # low_memory trades accuracy for memory, as Liger does: the loss is as accurate, the gradients
    # are rounded to bf16 in the forward (once more for an incoming gradient other than 1) and the
    # weight gradient once per chunk (5 chunks here). Documented bound: within 2x eager's error.
    low_memory = lambda h, w: fused_linear_cross_entropy(h, w, target, chunk_rows=8, low_memory=True)  # noqa: E731
    mine = errors(low_memory, [hidden, weight], reference, torch.bfloat16)
    base = errors(eager["hf"], [hidden, weight], reference, torch.bfloat16)
    assert mine[0][0] <= SLACK * base[0][0]
    for (err, _), (eager_err, _) in zip(mine[1:], base[1:]):
        assert err <= 2 * eager_err


def test_swap_cross_entropy_loss():
    loss_fn = nn.CrossEntropyLoss(ignore_index=0, label_smoothing=0.1)
    weighted = nn.CrossEntropyLoss(weight=torch.ones(5))
    holder = nn.ModuleDict({"loss": loss_fn, "weighted": weighted, "proj": nn.Linear(3, 5)})
    report = swap(holder, ["cross_entropy"])
    assert [r[0] for r in report.swapped] == ["loss"] and holder["weighted"] is weighted
    new = holder["loss"]
    assert isinstance(new, CrossEntropyLoss) and (new.ignore_index, new.label_smoothing) == (0, 0.1)
    unswap(holder)
    assert holder["loss"] is loss_fn


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_swapped_loss_takes_class_probability_targets(reduction):
    # nn.CrossEntropyLoss takes soft (floating-point) targets too, which the kernel does not: F.cross_entropy's.
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 10, generator=gen, requires_grad=True)
    soft = torch.softmax(torch.randn(4, 10, generator=gen), -1)
    eager = nn.CrossEntropyLoss(reduction=reduction, label_smoothing=0.1)
    holder = nn.ModuleDict({"loss": eager})
    expected = eager(logits, soft)
    assert [r[0] for r in swap(holder, ["cross_entropy"]).swapped] == ["loss"]
    got = holder["loss"](logits, soft)
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(torch.autograd.grad(got.sum(), logits), torch.autograd.grad(expected.sum(), logits))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gradient_written_in_forward(reduction):
    """With mean/sum the forward writes the gradient for an incoming 1; the backward keeps it for 1 and
    recomputes for anything else, also on a second backward through the same graph."""
    logits, target = problem(20, 300, seed=5)
    x = logits.detach().float().requires_grad_()
    ref = x.detach().double().requires_grad_()
    loss = cross_entropy(x, target, reduction=reduction, label_smoothing=0.1)
    ref_loss = F.cross_entropy(ref, target, reduction=reduction, label_smoothing=0.1)
    (g1,) = torch.autograd.grad(loss, x, retain_graph=True)  # incoming gradient 1: the forward's
    (r1,) = torch.autograd.grad(ref_loss, ref, retain_graph=True)
    kept = g1.clone()
    (g2,) = torch.autograd.grad(loss, x, torch.tensor(-2.5))  # second backward, another incoming gradient
    (r2,) = torch.autograd.grad(ref_loss, ref, torch.tensor(-2.5, dtype=torch.float64))
    assert rel_err(g1, r1) < 1e-6 and rel_err(g2, r2) < 1e-6
    assert torch.equal(g1, kept)  # the first gradient was not overwritten by the second backward
    assert g1[::5].abs().max() == 0  # ignored rows


@pytest.mark.parametrize("low_memory", [False, True])
def test_fused_linear_cross_entropy_no_rows(low_memory):
    """No rows: no chunk writes the weight gradient, which is then zero (and chunk sizes stay positive)."""
    hidden = torch.randn(0, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    loss = fused_linear_cross_entropy(hidden, weight, torch.zeros(0, dtype=torch.long), reduction="sum",
                                      low_memory=low_memory)
    grad_hidden, grad_weight = torch.autograd.grad(loss, [hidden, weight])
    assert loss.item() == 0 and grad_hidden.shape == (0, 16)
    assert grad_weight.dtype == weight.dtype and not grad_weight.any()


def test_backward_scaling_rounds_once():
    """The backward's scale-and-cast (fp32 sums times the incoming gradient, rounded once to bf16) and the
    low-memory in-place scaling, which leaves the values alone for an incoming 1 but bumps the version."""
    ce = importlib.import_module("profiler_svc.kernels.cross_entropy")  # the module, not the function
    gen = torch.Generator().manual_seed(7)
    t = torch.randn(37, 1000, generator=gen)
    for g in (torch.tensor(1.0), torch.tensor(-0.37)):
        assert torch.equal(ce._scaled_cast(t, g, torch.bfloat16), torch.mul(t, g).to(torch.bfloat16))
        b = t.to(torch.bfloat16)
        expected, version = (b.float() * g).to(torch.bfloat16), b._version
        ce._scale_(b, g)
        assert torch.equal(b, expected) and b._version > version


def test_low_memory_gradients_are_handed_out_once():
    gen = torch.Generator().manual_seed(6)
    hidden = torch.randn(6, 8, generator=gen, requires_grad=True)
    weight = torch.randn(20, 8, generator=gen, requires_grad=True)
    target = torch.randint(0, 20, (6,), generator=gen)
    loss = fused_linear_cross_entropy(hidden, weight, target, low_memory=True)
    expected = torch.autograd.grad(fused_linear_cross_entropy(hidden, weight, target), [hidden, weight])
    got = torch.autograd.grad(loss, [hidden, weight], retain_graph=True)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)  # fp32: the same numbers, only the buffers differ
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, [hidden, weight])  # scaled in place once: a second backward is refused


@pytest.mark.parametrize("reverse,prefetch,per_sm", [(True, True, 1.0), (False, True, 2.0), (True, False, 0)])
def test_wide_row_settings(monkeypatch, reverse, prefetch, per_sm):
    """The wide-row path (online pass, then the gradient pass, optionally last chunk first, optionally each
    chunk loaded a step ahead; a grid of a few programs looping over rows) at a width the interpreter
    runs: the thresholds are lowered."""
    ce = importlib.import_module("profiler_svc.kernels.cross_entropy")  # the module, not the function

    monkeypatch.setattr(ce, "ONE_TILE_V", 256)
    monkeypatch.setitem(ce.WIDE, "BLOCK_N", 64)
    monkeypatch.setitem(ce.WIDE, "REVERSE", reverse)
    monkeypatch.setitem(ce.WIDE, "PREFETCH", prefetch)
    monkeypatch.setitem(ce.WIDE_FWD, "PREFETCH", prefetch)
    monkeypatch.setitem(ce.WIDE, "PROGRAMS_PER_SM", per_sm)
    monkeypatch.setitem(ce.WIDE_FWD, "BLOCK_N", 128)
    ce._row_launch.cache_clear()
    try:
        logits, target = problem(11, 1000, seed=7)  # 4 programs under the interpreter: several rows each
        assert ce._row_launch(1000, True)[1]["ONE_TILE"] is False
        for reduction, smoothing in (("mean", 0.1), ("none", 0.0)):
            x = logits.detach().float().requires_grad_()
            ref = logits.detach().clone().requires_grad_()
            kwargs = dict(reduction=reduction, label_smoothing=smoothing)
            loss, ref_loss = cross_entropy(x, target, **kwargs), F.cross_entropy(ref, target, **kwargs)
            dy = torch.randn(ref_loss.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
            (g,), (r,) = torch.autograd.grad(loss, x, dy.float()), torch.autograd.grad(ref_loss, ref, dy)
            assert rel_err(loss, ref_loss) < 1e-6 and rel_err(g, r) < 1e-6
        with torch.no_grad():  # the loss alone (WIDE_FWD)
            x = logits.detach()
            assert rel_err(cross_entropy(x.float(), target), F.cross_entropy(x, target)) < 1e-6
    finally:
        ce._row_launch.cache_clear()


def test_pipelined_rows_fit_shared_memory():
    """The pipelined row loop (32k-logit bf16 rows: 64 KiB of shared memory per stage ahead) keeps the
    stages that fit: all three on an H100 (227 KiB a program) or an A100 (163 KiB), one row ahead on
    99 KiB parts, none on 48 KiB ones."""
    from profiler_svc.kernels._launch import pipeline_stages

    row = 32768 * 2
    assert pipeline_stages(3, row, 227 * 1024) == 3
    assert pipeline_stages(3, row, 163 * 1024) == 3
    assert pipeline_stages(3, row, 99 * 1024) == 2
    assert pipeline_stages(3, row, 48 * 1024) == 1
    assert pipeline_stages(1, row, 0) == 1


# Targets torch refuses (an IndexError on the CPU, a device-side assert on a GPU), with the ignore_index in use:
# past the last class, negative, and the usual -100 where another class is ignored.
OUT_OF_RANGE = {"V": (50, -100), "negative": (-5, -100), "-100 not ignored": (-100, 0)}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("bad", sorted(OUT_OF_RANGE))
def test_target_out_of_range_gives_nan_not_a_loss(reduction, bad):
    """No host check (a sync per step): the row's loss and gradient are NaN, so a reduced loss is NaN; the
    other rows are as if that row were ignored."""
    value, ignore_index = OUT_OF_RANGE[bad]
    logits, target = problem(9, 50, seed=11)
    target[::5] = ignore_index
    target[3] = value
    others = torch.arange(9) != 3
    valid = target.clone()
    valid[3] = ignore_index
    ref_x = logits.detach().clone().requires_grad_()
    ref = F.cross_entropy(ref_x, valid, ignore_index=ignore_index, reduction=reduction)
    x = logits.detach().float()
    with torch.no_grad():
        inference = cross_entropy(x, target, ignore_index, reduction)
    x.requires_grad_()
    loss = cross_entropy(x, target, ignore_index, reduction)
    for got in (inference, loss.detach()):
        if reduction == "none":
            assert got[3].isnan() and rel_err(got[others], ref.detach()[others]) < 1e-6
        else:
            assert got.isnan()
    # For mean/sum the forward wrote the gradient for an incoming 1: the first backward, with another incoming
    # gradient, rewrites it; the second recomputes it.
    for dy in (torch.full(ref.shape, -2.5, dtype=torch.float64), torch.ones(ref.shape, dtype=torch.float64)):
        (g,) = torch.autograd.grad(loss, x, dy.float(), retain_graph=True)
        assert g[3].isnan().all() and g[others].isfinite().all()
        if reduction != "mean":  # the mean's other rows are divided by a count that holds the bad row
            (r,) = torch.autograd.grad(ref, ref_x, dy, retain_graph=True)
            assert rel_err(g[others], r[others]) < 1e-6


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("low_memory", [False, True])
def test_fused_linear_cross_entropy_target_out_of_range_gives_nan(reduction, low_memory):
    gen = torch.Generator().manual_seed(12)
    m, h, v = 10, 8, 40
    hidden = torch.randn(m, h, generator=gen, requires_grad=True)
    weight = torch.randn(v, h, generator=gen, requires_grad=True)
    target = torch.randint(0, v, (m,), generator=gen)
    target[2], target[6], target[8] = v, -5, -100
    bad = torch.zeros(m, dtype=torch.bool)
    bad[[2, 6]] = True
    valid = target.masked_fill(bad, -100)
    kwargs = dict(reduction=reduction, chunk_rows=3, low_memory=low_memory)  # several chunks, a ragged last one
    with torch.no_grad():
        inference = fused_linear_cross_entropy(hidden, weight, target, **kwargs)
    loss = fused_linear_cross_entropy(hidden, weight, target, **kwargs)
    ref = F.cross_entropy(hidden @ weight.t(), valid, reduction=reduction)
    for got in (inference, loss.detach()):
        if reduction == "none":
            assert got[bad].isnan().all() and rel_err(got[~bad], ref.detach()[~bad]) < 1e-6
        else:
            assert got.isnan()
    for dy in (torch.full(ref.shape, -2.5), torch.ones(ref.shape)):
        grad_hidden, grad_weight = torch.autograd.grad(loss, [hidden, weight], dy, retain_graph=not low_memory)
        assert grad_hidden[bad].isnan().all() and grad_hidden[~bad].isfinite().all()
        assert grad_weight.isnan().all()  # each class's row sums over the bad rows' gradients too
        if reduction != "mean":
            ref_hidden = torch.autograd.grad(ref, hidden, dy, retain_graph=True)[0]
            assert rel_err(grad_hidden[~bad], ref_hidden[~bad]) < 1e-5
        if low_memory:  # its gradients are handed out once
            break
