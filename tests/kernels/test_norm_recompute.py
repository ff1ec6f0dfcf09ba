"""A norm's output saved by its consumers as a recipe, freed after the forward and computed again in the
backward (kernels._norm.saved_as_recipe; TRITON_INTERPRET=1 on CPU)."""
import gc
import weakref

import pytest
import torch
import transformers
from torch import nn

from profiler_svc.kernels import _norm, placement, rms_norm, swap


@pytest.fixture
def every_size(monkeypatch):
    monkeypatch.setattr(placement, "RECOMPUTE_NORM_OUTPUT_MIN", 0)


def _inputs():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 16, generator=gen, requires_grad=True)
    w = (1 + 0.1 * torch.randn(16, generator=gen)).requires_grad_()
    q, k = nn.Linear(16, 8), nn.Linear(16, 4)
    return x, w, q, k


def _step(x, w, q, k, recipe: bool):
    h = x * 1.5  # a non-leaf input, as a residual stream is
    y = rms_norm(h, w)
    alive = weakref.ref(y.untyped_storage())  # the memory itself: a saved view holds it, not y's tensor object
    with _norm.saved_as_recipe(y) if recipe else torch.enable_grad():
        out = (q(y).sum() + k(y).pow(2).sum())
    del y
    gc.collect()
    return out, h, alive


def test_the_output_is_freed_and_computed_again_bit_for_bit_once(every_size, monkeypatch):
    x, w, q, k = _inputs()
    params = [x, w, *q.parameters(), *k.parameters()]
    out, _, alive = _step(x, w, q, k, recipe=False)
    assert alive() is not None  # the projections hold it for their weight gradients
    expected = torch.autograd.grad(out, params)

    calls = []
    forward = _norm._forward
    monkeypatch.setattr(_norm, "_forward", lambda *a, **kw: calls.append(kw.get("stats", True)) or forward(*a, **kw))
    out, _, alive = _step(x, w, q, k, recipe=True)
    assert alive() is None
    assert calls == [True]
    grads = torch.autograd.grad(out, params)
    assert calls == [True, False]  # one recompute, shared by both projections
    for a, b in zip(expected, grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_below_the_size_the_output_is_kept():
    x, w, q, k = _inputs()
    assert x.numel() < placement.RECOMPUTE_NORM_OUTPUT_MIN
    out, _, alive = _step(x, w, q, k, recipe=True)
    assert alive() is not None and out.grad_fn is not None


def test_an_input_modified_after_the_forward_is_refused(every_size):
    x, w, q, k = _inputs()
    out, h, _ = _step(x, w, q, k, recipe=True)
    with torch.no_grad():
        h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, [x])


def test_other_saved_tensor_hooks_are_not_shadowed(every_size):
    x, w, q, k = _inputs()
    seen = []

    def pack(t):
        seen.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out, _, alive = _step(x, w, q, k, recipe=True)
    assert alive() is not None and out.grad_fn is not None
    assert (10, 16) in seen  # the projections' 2-D view of the norm output reached the outer hooks


def _llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128)
    return transformers.LlamaForCausalLM(config)


def test_a_swapped_llama_frees_its_norm_outputs_and_trains_as_before(monkeypatch):
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    grads, alive = {}, {}
    for recompute in (False, True):
        monkeypatch.setattr(placement, "RECOMPUTE_NORM_OUTPUT_MIN", 0 if recompute else 1 << 62)
        model = _llama()
        report = swap(model, ["rms_norm", "rope", "swiglu"])
        assert {row[2] for row in report.swapped} == {"rms_norm", "rope", "swiglu"}
        outputs = []
        for module in model.modules():
            if type(module).__name__ == "RMSNorm":
                module.register_forward_hook(lambda _m, _i, out: outputs.append(weakref.ref(out.untyped_storage())))
        loss = model(input_ids=ids, labels=ids).loss
        gc.collect()
        alive[recompute] = sum(ref() is not None for ref in outputs)
        loss.backward()
        grads[recompute] = [p.grad for p in model.parameters()]
    # 2 layers x (attention's and MLP's norm) + the final norm, which feeds lm_head (no stand-in of ours)
    assert alive == {False: 5, True: 1}
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
