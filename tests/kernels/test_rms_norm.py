import pytest
import torch
import torch.nn.functional as F
from kernel_numerics import assert_no_worse, rel_err
from kernel_numerics import assert_mixed_no_worse
from torch import nn

from profiler_svc.kernels import rms_norm
from profiler_svc.kernels.rms_norm import RMSNorm

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def hf_llama_rms_norm(x, w, eps=1e-6):  # transformers' LlamaRMSNorm.forward, verbatim numerics
    dtype = x.dtype
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(dtype)


def hf_gemma_rms_norm(x, w, eps=1e-6):  # transformers' GemmaRMSNorm.forward
    h = x.float()
    out = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + w.float())).type_as(x)


def reference(x, w, eps=1e-6, offset=0.0):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w + offset)


def inputs(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen, dtype=torch.float64)).requires_grad_()
    return [x, w]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 1000), (3, 5, 96), (2, 20000)])
def test_llama_numerics_no_worse_than_eager(dtype, shape):
    baselines = {"hf_llama": hf_llama_rms_norm, "F.rms_norm": lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-6)}
    assert_no_worse(lambda x, w: rms_norm(x, w, 1e-6), baselines, inputs(shape, 1), reference, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_single_column(dtype):
    # N=1: y = ±w and dx is ~0 (pure cancellation), so dx is checked in absolute terms only.
    x, w = inputs((64, 1), 7)
    xs, ws = (t.detach().to(dtype).requires_grad_() for t in (x, w))
    y = rms_norm(xs, ws, 1e-6)
    assert rel_err(y, reference(x, w)) <= 1.1 * rel_err(hf_llama_rms_norm(xs, ws), reference(x, w)) + 1e-7
    dx, dw = torch.autograd.grad(y.sum(), [xs, ws])
    dx64, dw64 = torch.autograd.grad(reference(x, w).sum(), [x, w])
    assert (dx.double() - dx64).abs().max() <= torch.finfo(dtype).eps
    assert rel_err(dw, dw64) <= torch.finfo(dtype).eps


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemma_offset_numerics_no_worse_than_eager(dtype):
    x, w = inputs((37, 1000), 2)
    w = (w.detach() - 1).requires_grad_()  # Gemma stores w - 1
    assert_no_worse(
        lambda x, w: rms_norm(x, w, 1e-6, offset=1.0), {"hf_gemma": hf_gemma_rms_norm}, [x, w],
        lambda x, w: reference(x, w, offset=1.0), dtype,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_residual_add(dtype):
    gen = torch.Generator().manual_seed(3)
    x, r = (torch.randn(9, 300, generator=gen, dtype=torch.float64) for _ in range(2))
    w = torch.randn(300, generator=gen, dtype=torch.float64)
    xs, rs, ws = (t.to(dtype).requires_grad_() for t in (x, r, w))
    y, s = rms_norm(xs, ws, 1e-6, residual=rs)
    assert torch.equal(s, xs + rs) or rel_err(s, x + r) <= rel_err(xs + rs, x + r)
    assert rel_err(y, reference(x + r, w)) <= 1.1 * rel_err(hf_llama_rms_norm(xs + rs, ws), reference(x + r, w)) + 1e-7
    # Gradients flow to both x and residual, through y and through the returned sum.
    dy, ds = torch.randn_like(y), torch.randn_like(s)
    (y * dy + s * ds).sum().backward()
    x64, r64, w64 = (t.clone().requires_grad_() for t in (x, r, w))
    s64 = x64 + r64
    (reference(s64, w64) * dy.double() + s64 * ds.double()).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert rel_err(xs.grad, x64.grad) < tol and torch.equal(xs.grad, rs.grad)
    assert rel_err(ws.grad, w64.grad) < tol


def test_non_contiguous_input_and_no_weight():
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(64, 48, generator=gen)
    x = base.t()  # (48, 64), column stride 48
    assert not x.is_contiguous()
    out = rms_norm(x, None, 1e-5)
    assert out.shape == x.shape
    assert rel_err(out, reference(x.double(), torch.ones(64, dtype=torch.float64), 1e-5)) < 1e-6


def test_module_shares_parameter_and_rejects_bad_weight():
    m = RMSNorm(16, eps=1e-5, offset=1.0)
    assert torch.count_nonzero(m.weight) == 0  # Gemma-style init: w = 0 means scale 1
    x = torch.randn(2, 16)
    assert rel_err(m(x), reference(x.double(), m.weight.double(), 1e-5, 1.0)) < 1e-6
    with pytest.raises(ValueError, match="weight shape"):
        rms_norm(x, torch.ones(15))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_torch_rms_norm_without_eps_is_swapped_with_the_eps_it_computes_with(dtype):
    """nn.RMSNorm(eps=None) on 16-bit inputs computes in fp32 with fp32's epsilon, not its input dtype's:
    on small inputs (mean square ~1e-4) the two differ by far more than a rounding."""
    from profiler_svc.kernels.swap import swapped
    model = torch.nn.Sequential(torch.nn.RMSNorm(64, eps=None)).to(dtype)
    x = torch.full((3, 64), 1e-2, dtype=dtype)
    expected = model(x)
    with swapped(model, "rms_norm"):
        assert type(model[0]) is RMSNorm and model[0].eps == torch.finfo(torch.float32).eps
        torch.testing.assert_close(model(x), expected)


def test_strided_weight_forward_and_backward():
    # w[::2]: the kernels index the weight by column alone, so a strided view must not be read as dense.
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(4, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    base = torch.randn(16, generator=gen, dtype=torch.float64, requires_grad=True)
    y = rms_norm(x, base[::2], 1e-6)
    assert rel_err(y, reference(x, base[::2])) < 1e-12
    grads = torch.autograd.grad(y.square().sum(), [x, base])
    expected = torch.autograd.grad(reference(x, base[::2]).square().sum(), [x, base])
    assert all(rel_err(g, e) < 1e-12 for g, e in zip(grads, expected))


@pytest.mark.parametrize("x_dtype, w_dtype", [(torch.int64, None), (torch.int64, torch.float32), (torch.float32, torch.int32)])
def test_integer_tensors_are_rejected(x_dtype, w_dtype):
    x = torch.randint(-5, 5, (2, 4)).to(x_dtype)
    w = torch.ones(4, dtype=w_dtype) if w_dtype else None
    with pytest.raises(TypeError, match="must be a floating-point tensor"):
        rms_norm(x, w)


@pytest.mark.parametrize("x_dtype, r_dtype, w_dtype, offset", [
    (torch.bfloat16, torch.float32, torch.float32, 0.0),  # autocast: a bf16 block's output into the fp32 stream
    (torch.bfloat16, torch.float32, torch.float32, 1.0),  # the same into Gemma's (1 + w) norm
    (torch.float32, torch.bfloat16, torch.bfloat16, 0.0),  # an fp32 output into a bf16 stream, bf16 weight
    (torch.float16, torch.bfloat16, torch.float16, 0.0),  # neither is fp32, their sum is
])
def test_residual_in_another_dtype_is_added_and_normalized_as_eager(x_dtype, r_dtype, w_dtype, offset):
    """Eager's decoder layer: h = residual + x in torch's promoted dtype, then HF's RMSNorm of h, whose
    w * h keeps that dtype; both outputs and every gradient against it."""
    gen = torch.Generator().manual_seed(10)
    x, r = (torch.randn(9, 300, generator=gen).to(dtype) for dtype in (x_dtype, r_dtype))
    w = ((1 - offset) + 0.1 * torch.randn(300, generator=gen)).to(w_dtype)  # Gemma stores w - 1
    eps = 1e-5  # not rms_norm's default, so an eps lost on the way shows
    hf_norm = hf_gemma_rms_norm if offset else hf_llama_rms_norm

    def ours(x, r, w):
        return rms_norm(x, w, eps, offset=offset, residual=r)

    def eager(x, r, w):
        h = r + x
        return hf_norm(h, w, eps), h

    def exact(x, r, w):
        h = r + x
        return reference(h, w, eps, offset), h

    assert torch.equal(ours(x, r, w)[1], r + x)  # eager's promoted add, bit for bit
    assert_mixed_no_worse(ours, eager, exact, [x, r, w])


def test_swapped_norm_with_a_weight_in_another_dtype_follows_the_module():
    # bf16 activations into an fp32-weight norm: LlamaRMSNorm's w·h returns fp32, nn.RMSNorm keeps bf16.
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from profiler_svc.kernels import swap
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(11)).bfloat16()
    for norm in (LlamaRMSNorm(16), nn.RMSNorm(16, eps=1e-6)):
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
            expected = norm(x)
        holder = nn.Sequential(norm)
        assert swap(holder, ["rms_norm"]).swapped
        with torch.no_grad():
            got = holder[0](x)
        assert got.dtype == expected.dtype
        torch.testing.assert_close(got, expected)


def test_zero_width_rows_give_the_empty_result_and_a_0d_input_a_clear_error():
    x, w = torch.randn(4, 0, requires_grad=True), torch.ones(0, requires_grad=True)
    y = rms_norm(x, w)
    assert y.shape == (4, 0)
    y.sum().backward()
    assert x.grad.shape == (4, 0) and w.grad.shape == (0,)
    y, s = rms_norm(torch.randn(4, 0), None, offset=1.0, residual=torch.randn(4, 0))
    assert y.shape == s.shape == (4, 0)
    with pytest.raises(ValueError, match="at least one dimension"):
        rms_norm(torch.tensor(1.0))


def test_a_swapped_norm_loaded_with_assign_uses_its_new_weight_in_mixed_dtypes():
    """load_state_dict(assign=True) gives the swapped module a new weight; its mixed-dtype path ran the replaced
    module, which kept the old one (3x off)."""
    from torch import nn

    from profiler_svc.kernels import swap
    LlamaRMSNorm = pytest.importorskip("transformers.models.llama.modeling_llama").LlamaRMSNorm
    model = nn.Sequential(LlamaRMSNorm(16))
    assert [s for *_, s, _, _ in swap(model, ["rms_norm"]).swapped] == ["rms_norm"]
    model.load_state_dict({"0.weight": torch.full((16,), 3.0)}, assign=True)
    x = torch.randn(4, 16).to(torch.bfloat16)
    eager = LlamaRMSNorm(16)
    eager.weight.data.fill_(3.0)
    torch.testing.assert_close(model(x), eager(x))
