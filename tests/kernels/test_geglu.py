import pytest
import torch
import torch.nn.functional as F
from kernel_numerics import assert_no_worse

from profiler_svc.kernels import geglu, swapped
from profiler_svc.kernels.geglu import SWAP
from profiler_svc.kernels.swiglu import GatedMLP

transformers = pytest.importorskip("transformers")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(approximate):  # also eager: HF's act_fn(gate_proj(x)) * up_proj(x) with a GELU act_fn
    return lambda gate, up: F.gelu(gate, approximate=approximate) * up


def inputs(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(3 * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_() for _ in range(2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("approximate", ["tanh", "none"])
@pytest.mark.parametrize("shape", [(37, 1000), (64, 1)])  # many blocks: test_swiglu (same kernels)
def test_numerics_no_worse_than_eager(dtype, approximate, shape):
    ours = lambda g, u: geglu(g, u, approximate)  # noqa: E731
    ref = reference(approximate)
    assert_no_worse(ours, {"F.gelu*up": ref}, inputs(shape, 1), ref, dtype)


def test_bad_input():
    with pytest.raises(ValueError, match="approximate"):
        geglu(torch.randn(2, 4), torch.randn(2, 4), "fast")
    with pytest.raises(ValueError, match="same shape"):
        geglu(torch.randn(2, 4), torch.randn(2, 5))


def tiny_gemma():
    torch.manual_seed(0)
    cfg = transformers.GemmaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, vocab_size=128,
    )
    return transformers.GemmaForCausalLM(cfg).eval()


def tiny_llama_erf_gelu():
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4, vocab_size=128,
        hidden_act="gelu",
    )
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("make, act", [(tiny_gemma, 1), (tiny_llama_erf_gelu, 0)])
def test_gelu_gated_mlps_swapped_and_restored(make, act):
    model = make()
    originals = {n: m for n, m in model.named_modules() if n.endswith(".mlp")}
    ids = torch.randint(0, 128, (2, 7))
    with torch.no_grad():
        expected = model(ids).logits

    with swapped(model, ["geglu", "swiglu"]) as report:
        assert sorted(row[0] for row in report.swapped) == sorted(originals)
        assert report.skipped == [] and all(row[2] == "geglu" for row in report.swapped)
        assert all(isinstance(model.get_submodule(n), GatedMLP) and model.get_submodule(n).act == act for n in originals)
        with torch.no_grad():
            torch.testing.assert_close(model(ids).logits, expected, rtol=1e-5, atol=1e-5)

    assert all(model.get_submodule(n) is m for n, m in originals.items())


def test_silu_mlp_is_not_geglus():
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
    ))
    assert not SWAP.matches(llama.model.layers[0].mlp)
