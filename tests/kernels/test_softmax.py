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
@pytest.mark.parametrize("shape", [(37, 1000), (64, 1), (3, 50, 96), (2, 40000)])  # 40000: the chunked path
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


def test_swap_replaces_last_dim_softmax_only():
    model = nn.Sequential(nn.Linear(8, 8), nn.Softmax(dim=-1), nn.Softmax(dim=0))
    last, first = model[1], model[2]
    report = swap(model, ["softmax"])
    assert [r[0] for r in report.swapped] == ["1"] and isinstance(model[1], Softmax) and model[2] is first
    x = torch.randn(3, 8)
    torch.testing.assert_close(model(x), nn.Sequential(model[0], last, first)(x))
    unswap(model)
    assert model[1] is last
