import math

import pytest
import torch
import torch.nn.functional as F
from kernel_numerics import assert_no_worse
from torch import nn

from profiler_svc.kernels import gelu_tanh, swap, unswap
from profiler_svc.kernels.gelu_tanh import SWAP, GELUTanh

transformers = pytest.importorskip("transformers")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def hf_new_gelu(x):  # transformers' NewGELUActivation.forward (GPT-2), verbatim numerics
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def reference(x):
    return F.gelu(x, approximate="tanh")


def inputs(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    # scale 3: covers the tails, where 1 + tanh cancels, as well as the curved middle
    return [(3 * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_()]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 1000), (64, 1), (1,), (2, 17001)])
def test_numerics_no_worse_than_eager(dtype, shape):
    assert_no_worse(gelu_tanh, {"F.gelu": reference, "hf_new_gelu": hf_new_gelu}, inputs(shape, 1), reference, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_non_contiguous_input(dtype):
    t = lambda f: lambda x: f(x.t())  # noqa: E731  (a transposed view: copied to contiguous inside)
    assert_no_worse(t(gelu_tanh), {"F.gelu": t(reference)}, inputs((1000, 37), 2), t(reference), dtype)


def test_empty_and_bad_input():
    assert gelu_tanh(torch.empty(0, 8)).shape == (0, 8)
    with pytest.raises(TypeError, match="floating-point"):
        gelu_tanh(torch.arange(6))


def test_matches_tanh_gelu_by_behaviour_not_name():
    acts = transformers.activations
    assert all(SWAP.matches(m) for m in (
        acts.NewGELUActivation(), acts.GELUTanh(), acts.FastGELUActivation(), nn.GELU(approximate="tanh"),
    ))

    class GELUButDoubled(nn.Module):  # named like a GELU, computes something else
        def forward(self, x):
            return 2 * F.gelu(x, approximate="tanh")

    assert not any(SWAP.matches(m) for m in (
        acts.GELUActivation(), nn.GELU(), acts.QuickGELUActivation(), nn.SiLU(), GELUButDoubled(),
    ))


def tiny_gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg).eval()


def test_gpt2_activations_swapped_and_restored():
    model = tiny_gpt2()
    originals = {n: m for n, m in model.named_modules() if n.endswith("mlp.act")}
    ids = torch.randint(0, 64, (2, 9))
    with torch.no_grad():
        expected = model(ids).logits

    report = swap(model, ["gelu_tanh"])

    assert sorted(row[0] for row in report.swapped) == sorted(originals) and len(originals) == 2
    assert report.skipped == []
    assert all(isinstance(model.get_submodule(n), GELUTanh) for n in originals)
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)
    model(ids, labels=ids).loss.backward()  # trains through the swapped activations

    unswap(model)
    assert all(model.get_submodule(n) is m for n, m in originals.items())


# torch.compile(fullgraph=True) must not graph-break on the op, forward or backward. On a GPU: Inductor,
# which sees into the Triton kernels; on the CPU (Triton's interpreter) the op is opaque: aot_eager.
DEVICE, BACKEND = ("cuda", "inductor") if torch.cuda.is_available() else ("cpu", "aot_eager")


def test_compile_fullgraph_forward_backward():
    x = torch.randn(64, 1000, device=DEVICE, requires_grad=True)
    fn = lambda x: gelu_tanh(x * 2)  # noqa: E731
    torch._dynamo.reset()
    out, ref = torch.compile(fn, fullgraph=True, backend=BACKEND)(x), fn(x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(torch.autograd.grad(out.sum(), x)[0], torch.autograd.grad(ref.sum(), x)[0])
