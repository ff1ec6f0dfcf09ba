import pytest
import torch
import torch.nn.functional as F
from kernel_numerics import assert_no_worse, rel_err
from kernel_numerics import assert_mixed_no_worse

from profiler_svc.kernels import layer_norm
from profiler_svc.kernels.layer_norm import LayerNorm



def reference(x, w, b, eps=1e-5):
    mean = x.mean(-1, keepdim=True)
    var = (x - mean).pow(2).mean(-1, keepdim=True)
    return (x - mean) * torch.rsqrt(var + eps) * w + b


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(37, 1000), (64, 1), (3, 5, 96), (2, 20000)])
def test_numerics_no_worse_than_eager(dtype, shape):
    gen = torch.Generator().manual_seed(5)
    # A large common offset makes a naive E[x²] - E[x]² variance lose digits: the kernel must not.
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 4).requires_grad_()
    w = torch.randn(shape[-1], generator=gen, dtype=torch.float64).requires_grad_()
    b = torch.randn(shape[-1], generator=gen, dtype=torch.float64).requires_grad_()
    eager = {"F.layer_norm": lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b, 1e-5)}
    assert_no_worse(lambda x, w, b: layer_norm(x, w, b, 1e-5), eager, [x, w, b], reference, dtype)


def test_residual_no_bias_and_non_contiguous():
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(40, 33, generator=gen).t()  # (33, 40), not contiguous
    r = torch.randn(33, 40, generator=gen)
    w = torch.randn(40, generator=gen)
    y, s = layer_norm(x, w, None, 1e-5, residual=r)
    assert torch.equal(s, x + r)
    assert rel_err(y, reference((x + r).double(), w.double(), 0.0)) < 1e-6


def test_module_matches_nn_layer_norm():
    torch.manual_seed(0)
    ref = torch.nn.LayerNorm(24)
    with torch.no_grad():
        ref.weight.normal_(), ref.bias.normal_()
    m = LayerNorm(24)
    m.load_state_dict(ref.state_dict())
    x = torch.randn(3, 24, requires_grad=True)
    torch.testing.assert_close(m(x), ref(x))
    g = torch.autograd.grad(m(x).square().sum(), [x, m.weight, m.bias])
    g_ref = torch.autograd.grad(ref(x).square().sum(), [x, ref.weight, ref.bias])
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


def test_strided_weight_and_bias_forward_and_backward():
    # w[::2], b[::2]: the kernels index them by column alone, so strided views must not be read as dense.
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(16, generator=gen, dtype=torch.float64, requires_grad=True)
    y = layer_norm(x, w[::2], b[::2], 1e-5)
    expected = F.layer_norm(x, (8,), w[::2], b[::2], 1e-5)
    assert rel_err(y, expected) < 1e-12
    grads = torch.autograd.grad(y.square().sum(), [x, w, b])
    expected_grads = torch.autograd.grad(expected.square().sum(), [x, w, b])
    assert all(rel_err(g, e) < 1e-12 for g, e in zip(grads, expected_grads))


def test_integer_tensors_are_rejected():
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        layer_norm(torch.randint(-5, 5, (2, 4)))
    with pytest.raises(TypeError, match="bias must be a floating-point tensor"):
        layer_norm(torch.randn(2, 4), torch.ones(4), torch.zeros(4, dtype=torch.int64))


def test_zero_width_rows_give_the_empty_result():
    x = torch.randn(4, 0, requires_grad=True)
    y = layer_norm(x, torch.ones(0), torch.zeros(0))
    assert y.shape == (4, 0)
    y.sum().backward()
    assert x.grad.shape == (4, 0)


@pytest.mark.parametrize("x_dtype, r_dtype", [
    (torch.bfloat16, torch.float32),  # autocast: a bf16 block's output into the fp32 stream
    (torch.float32, torch.bfloat16),  # an fp32 output into a bf16 stream
    (torch.float16, torch.bfloat16),  # neither is fp32, their sum is
])
@pytest.mark.parametrize("bias", [True, False])
def test_residual_in_another_dtype_is_added_and_normalized_as_eager(x_dtype, r_dtype, bias):
    """Eager's block: h = residual + x in torch's promoted dtype (fp32 here, as are the norm's parameters),
    then F.layer_norm of h; both outputs and every gradient against it."""
    gen = torch.Generator().manual_seed(10)
    x = (torch.randn(9, 300, generator=gen) * 2 + 4).to(x_dtype)  # an offset mean, as in the test above
    r = torch.randn(9, 300, generator=gen).to(r_dtype)
    params = [torch.randn(300, generator=gen) for _ in range(2 if bias else 1)]
    eps = 1e-6  # not layer_norm's default, so an eps lost on the way shows

    def ours(x, r, w, b=None):
        return layer_norm(x, w, b, eps, residual=r)

    def eager(x, r, w, b=None):
        h = r + x
        return F.layer_norm(h, h.shape[-1:], w, b, eps), h

    def exact(x, r, w, b=None):
        h = r + x
        return reference(h, w, 0.0 if b is None else b, eps), h

    assert torch.equal(ours(x, r, *params)[1], r + x)  # eager's promoted add, bit for bit
    assert_mixed_no_worse(ours, eager, exact, [x, r, *params])
