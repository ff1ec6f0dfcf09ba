import importlib

import pytest
import torch
from kernel_numerics import assert_no_worse, rel_err
from torch import nn

from profiler_svc.kernels import softmax, swap, unswap
from profiler_svc.kernels.softmax import Softmax



def scores(shape, seed, scale=4.0):
    gen = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
# Peaked softmax rows have few effective values: enough rows keep the error estimate steady.
# 20000, 20001: one tile of 32768 columns (16-bit backward: the whole row, as int32 pairs at an even width;
# fp32: two passes); 40000: the chunked path
@pytest.mark.parametrize("shape", [(37, 1000), (64, 1), (3, 50, 96), (8, 20000), (8, 20001), (2, 40000)])
def test_numerics_no_worse_than_eager(dtype, shape):
    eager = {"torch.softmax": lambda x: torch.softmax(x, -1), "float-upcast": lambda x: torch.softmax(x.float(), -1).to(x.dtype)}
    assert_no_worse(softmax, eager, [scores(shape, 1)], lambda x: torch.softmax(x, -1), dtype)


def test_masked_rows_and_other_dims():
    x = scores((4, 70000), 2).detach().float()  # wider than 65k: the online pass
    x[0, :69000] = -float("inf")  # most of a row masked (whole chunks of -inf lanes)
    x[1] = -float("inf")  # a fully masked row is NaN, as in eager
    y = softmax(x)
    ref = torch.softmax(x.double(), -1)
    assert torch.isnan(y[1]).all() and torch.isnan(ref[1]).all()
    assert rel_err(y[[0, 2, 3]], ref[[0, 2, 3]]) < 1e-6
    assert torch.allclose(y[[0, 2, 3]].sum(-1), torch.ones(3), atol=1e-5)
    z = scores((6, 5, 7), 3).detach().float()
    torch.testing.assert_close(softmax(z, dim=1), torch.softmax(z, dim=1))
    zt = z.transpose(0, 2)  # non-contiguous input
    torch.testing.assert_close(softmax(zt), torch.softmax(zt, -1))
    with pytest.raises(ValueError, match="floating-point"):
        softmax(torch.ones(3, dtype=torch.long))
    for bad in (3, -4):  # out of range for a 3-d tensor, as torch says: not wrapped to another dim
        with pytest.raises(IndexError, match="out of range"):
            softmax(z, dim=bad)
        with pytest.raises(IndexError):
            torch.softmax(z, dim=bad)


def test_swap_replaces_last_dim_softmax_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.Softmax(dim=-1), nn.Softmax(dim=0))
    last, first = model[1], model[2]
    report = swap(model, ["softmax"])
    assert [r[0] for r in report.swapped] == ["1"] and isinstance(model[1], Softmax) and model[2] is first
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), nn.Sequential(model[0], last, first)(x))
    unswap(model)
    assert model[1] is last


@pytest.mark.parametrize("reverse,prefetch,per_sm", [(True, True, 1.0), (False, True, 0.5), (True, False, 0)])
def test_wide_row_settings(monkeypatch, reverse, prefetch, per_sm):
    """The wide-row path (two reads of each row, optionally the second last chunk first, optionally each
    chunk loaded a step ahead; a grid of a few programs looping over rows) at a width the interpreter
    runs: the thresholds are lowered."""
    sm = importlib.import_module("profiler_svc.kernels.softmax")  # the module, not the function

    monkeypatch.setattr(sm, "FWD_MAX_TILE_N", 256)
    monkeypatch.setattr(sm, "BWD_MAX_TILE_N_FP64", 256)
    for settings in (sm.WIDE, sm.WIDE_BWD):
        monkeypatch.setitem(settings, "BLOCK_N", 64)
        monkeypatch.setitem(settings, "REVERSE", reverse)
        monkeypatch.setitem(settings, "PREFETCH", prefetch)
        monkeypatch.setitem(settings, "PROGRAMS_PER_SM", per_sm)
    assert sm._settings(11, 1000, torch.device("cpu"), backward=True, fp64=True)[1]["ONE_TILE"] is False
    x = scores((11, 1000), 4)  # 4 programs under the interpreter: several rows each
    x32 = x.detach().float().requires_grad_()
    y = softmax(x32)
    ref = torch.softmax(x, -1)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    (g,), (r,) = torch.autograd.grad(y, x32, dy.float()), torch.autograd.grad(ref, x, dy)
    assert rel_err(y, ref) < 1e-6 and rel_err(g, r) < 1e-6


def test_two_pass_backward_under_one_tile_forward(monkeypatch):
    """Backward rows of fp32 inputs wider than BWD_MAX_TILE_N_FP64 but within FWD_MAX_TILE_N: one-tile forward,
    two-pass backward (MID_BWD settings); 16-bit inputs keep the whole row up to BWD_MAX_TILE_N."""
    sm = importlib.import_module("profiler_svc.kernels.softmax")
    monkeypatch.setattr(sm, "BWD_MAX_TILE_N_FP64", 256)
    monkeypatch.setitem(sm.MID_BWD, "BLOCK_N", 64)
    monkeypatch.setitem(sm.MID_BWD, "PROGRAMS_PER_SM", 1.0)
    cpu = torch.device("cpu")
    assert sm._settings(11, 1000, cpu, backward=False, fp64=True)[1]["ONE_TILE"] is True
    assert sm._settings(11, 1000, cpu, backward=True, fp64=True)[1]["ONE_TILE"] is False
    assert sm._settings(11, 1000, cpu, backward=True, fp64=False)[1]["ONE_TILE"] is True
    # The widest whole rows of 16-bit inputs take WIDEST_TILE_WARPS; fp64 math keeps row_tiles' warps.
    assert sm._settings(4, 32768, cpu, backward=True, fp64=False)[1]["num_warps"] == sm.WIDEST_TILE_WARPS
    assert sm._settings(4, 16384, cpu, backward=True, fp64=False)[1]["num_warps"] == 32
    x = scores((11, 1000), 6)
    x32 = x.detach().float().requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    (g,), (r,) = torch.autograd.grad(softmax(x32), x32, dy.float()), torch.autograd.grad(torch.softmax(x, -1), x, dy)
    assert rel_err(g, r) < 1e-6


def test_zero_width_rows_give_the_empty_result():
    x = torch.randn(4, 0, requires_grad=True)
    y = softmax(x)
    assert y.shape == (4, 0)
    y.sum().backward()
    assert x.grad.shape == (4, 0)
