"""swap on whole models as users hold them: modules shared between paths, user hooks, pickling (TRITON_INTERPRET=1 on CPU)."""
import copy
import io
import pickle

import pytest
import torch
from torch import nn

from profiler_svc.kernels import plan_swaps, swap, unswap
from profiler_svc.kernels.gelu_tanh import GELUTanh
from profiler_svc.kernels.layer_norm import LayerNorm
from profiler_svc.kernels.rms_norm import RMSNorm

transformers = pytest.importorskip("transformers")


class Block(nn.Module):
    def __init__(self, norm, act):
        super().__init__()
        self.norm, self.fc, self.act = norm, nn.Linear(16, 16), act

    def forward(self, x):
        return x + self.act(self.fc(self.norm(x)))


class GeGLU(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(16, 24), nn.Linear(16, 24), nn.Linear(24, 16)
        self.act_fn = act

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class SharedModules(nn.Module):
    """One RMSNorm and one tanh GELU shared by two blocks; the GELU is also a GeGLU's activation, and the model
    holds one LayerNorm under two attributes."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        norm, act = nn.RMSNorm(16, eps=1e-6), nn.GELU(approximate="tanh")
        with torch.no_grad():
            norm.weight.uniform_(0.5, 1.5)
        self.mlp = GeGLU(act)  # first: the GELU's first path is inside a block replaced whole
        self.blocks = nn.ModuleList([Block(norm, act), Block(norm, act)])
        self.final = nn.LayerNorm(16)
        self.head_norm = self.final

    def forward(self, x):
        x = self.mlp(x)
        for block in self.blocks:
            x = block(x)
        return self.head_norm(self.final(x))


SHARED_PATHS = {"norm": ["blocks.0.norm", "blocks.1.norm"], "act": ["blocks.0.act", "blocks.1.act"],
                "final": ["final", "head_norm"]}


def test_a_module_reachable_at_several_paths_is_swapped_and_restored_at_every_one():
    model = SharedModules()
    originals = {key: model.get_submodule(paths[0]) for key, paths in SHARED_PATHS.items()}
    x = torch.randn(3, 5, 16)
    with torch.no_grad():
        expected = model(x)

    report = swap(model, ["geglu", "rms_norm", "gelu_tanh", "layer_norm"])

    assert sorted((row[0], row[2]) for row in report.swapped) == [
        ("blocks.0.act", "gelu_tanh"), ("blocks.0.norm", "rms_norm"), ("final", "layer_norm"), ("mlp", "geglu")]
    for key, kind in (("norm", RMSNorm), ("act", GELUTanh), ("final", LayerNorm)):
        first, second = (model.get_submodule(path) for path in SHARED_PATHS[key])
        assert isinstance(first, kind) and second is first, key  # one replacement, the tie kept
    assert model.blocks[0].norm.weight is originals["norm"].weight
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, rtol=1e-5, atol=1e-5)

    unswap(model)
    for key, paths in SHARED_PATHS.items():
        assert all(model.get_submodule(path) is originals[key] for path in paths), key
    assert model.mlp.act_fn is originals["act"]


def test_a_hook_removed_or_added_while_hooks_are_silenced_stays_so():
    """Another thread (or a probed module) removes a hook while the probes run: it must stay removed; one registered
    meanwhile must keep working, its handle included."""
    from profiler_svc.kernels.swap import hooks_silenced
    norm = nn.LayerNorm(8)
    calls = []
    removed_global = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: calls.append("global"))
    removed_local = norm.register_forward_hook(lambda m, i, o: calls.append("local"))
    kept = norm.register_forward_pre_hook(lambda m, i: calls.append("kept"))
    with hooks_silenced([norm]):
        norm(torch.randn(2, 8))
        assert calls == []
        removed_global.remove()
        removed_local.remove()
        added = norm.register_forward_hook(lambda m, i, o: calls.append("added"))
    norm(torch.randn(2, 8))
    assert calls == ["kept", "added"]
    added.remove()
    kept.remove()
    norm(torch.randn(2, 8))
    assert calls == ["kept", "added"]


class SignallingLayerNorm(nn.LayerNorm):
    """A LayerNorm whose first call (a swap probe's) lets another thread run and waits until it has."""

    def __init__(self, n, probing, other_done):
        super().__init__(n)
        self.probing, self.other_done, self.waited = probing, other_done, []

    def forward(self, x):
        if not self.probing.is_set():
            self.probing.set()
            self.waited.append(self.other_done.wait(30))
        return super().forward(x)


def test_probes_silence_hooks_on_their_own_thread_only():
    """The probes ran with every global module hook swapped for a no-op: another thread's module calls meanwhile (a
    serving thread, a capture's labels) lost their global hooks, and its calls of the model's modules their own."""
    import threading
    from profiler_svc.kernels import SwapEntry

    probing, other_done = threading.Event(), threading.Event()
    probed = SignallingLayerNorm(16, probing, other_done)
    model = nn.Sequential(probed, nn.Linear(16, 16))
    elsewhere = nn.Linear(16, 16)  # another model's module
    calls, errors = [], []
    model[1].register_forward_hook(lambda *_: calls.append((threading.current_thread().name, "local")))
    handle = nn.modules.module.register_module_forward_hook(
        lambda module, *_: calls.append((threading.current_thread().name, type(module).__name__)))

    def other_thread():
        try:
            assert probing.wait(30)
            with torch.no_grad():
                elsewhere(torch.randn(2, 16))
                model[1](torch.randn(2, 16))
        except Exception as err:  # seen by the main thread's asserts
            errors.append(err)
        finally:
            other_done.set()

    entry = SwapEntry(name="signalling_norm", summary="a norm whose probe lets another thread run",
                      matches=lambda m: isinstance(m, SignallingLayerNorm), replace=lambda m: nn.LayerNorm(16),
                      example_inputs=lambda m: (torch.randn(2, 16),))
    thread = threading.Thread(target=other_thread, name="other")
    thread.start()
    try:
        report = swap(model, [entry])
    finally:
        other_done.set()
        thread.join(30)
        handle.remove()
    assert errors == [] and probed.waited == [True]
    assert [row[2] for row in report.swapped] == ["signalling_norm"]
    assert sorted(calls) == [("other", "Linear"), ("other", "Linear"), ("other", "local")]


def test_hooks_stay_silenced_until_the_last_window_open_on_any_thread_closes():
    """Two threads' windows overlap: the first to close put the hooks back under the second's probes."""
    import threading
    from profiler_svc.kernels.swap import hooks_silenced

    every = nn.modules.module
    norm = nn.LayerNorm(8)
    calls = []

    def global_hook(*_):
        calls.append("global")

    def local_hook(*_):
        calls.append("local")

    handles = [every.register_module_forward_hook(global_hook), norm.register_forward_hook(local_hook)]
    opened, close, closed = threading.Event(), threading.Event(), threading.Event()

    def first_window():
        with hooks_silenced([norm]):
            opened.set()
            close.wait(30)
        closed.set()

    thread = threading.Thread(target=first_window)
    thread.start()
    try:
        assert opened.wait(30)
        with hooks_silenced([norm]):
            close.set()
            assert closed.wait(30)
            norm(torch.randn(2, 8))
            assert calls == []
        assert every._global_forward_hooks[handles[0].id] is global_hook  # the very objects back
        assert norm._forward_hooks[handles[1].id] is local_hook
        norm(torch.randn(2, 8))
        assert calls == ["global", "local"]
    finally:
        close.set()
        thread.join(30)
        for handle in handles:
            handle.remove()


def test_probes_fire_no_user_hook_and_decide_as_without_hooks():
    def llama():
        torch.manual_seed(0)
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
        return transformers.LlamaForCausalLM(config).eval()

    unhooked = swap(llama())
    model = llama()
    calls = []
    for name, module in model.named_modules():
        module.register_forward_pre_hook(lambda *_, name=name: calls.append(("pre", name)))
        module.register_forward_hook(lambda *_, name=name: calls.append(("post", name)))
    every = nn.modules.module
    handles = [every.register_module_forward_pre_hook(lambda *_: calls.append("global pre")),
               every.register_module_forward_hook(lambda *_: calls.append("global post"))]
    try:
        report = swap(model)
        assert calls == []
        assert report.swapped and [row[:3] for row in report.swapped] == [row[:3] for row in unhooked.swapped]
        assert report.skipped == unhooked.skipped
        with torch.no_grad():
            model(torch.randint(0, 128, (1, 5)))
        assert {"pre", "post", "global pre", "global post"} <= {c if isinstance(c, str) else c[0] for c in calls}
        assert ("post", "model.layers.1.post_attention_layernorm") in calls  # a swapped module's hooks still fire
    finally:
        for handle in handles:
            handle.remove()


def _qwen3():
    torch.manual_seed(0)
    config = transformers.Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, head_dim=16)
    return transformers.Qwen3ForCausalLM(config).eval()


def _torch_round_trip(model):
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("copier", [lambda m: pickle.loads(pickle.dumps(m)), _torch_round_trip, copy.deepcopy],
                         ids=["pickle", "torch.save", "deepcopy"])
def test_a_swapped_model_pickles_and_comes_back_swapped(copier):
    model = _qwen3()
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
    report = swap(model)
    assert {row[2] for row in report.swapped} == {"residual_rms_norm", "rope", "rms_norm", "swiglu"}
    swapped_types = {name: type(module).__name__ for name, module in model.named_modules()}

    twin = copier(model)

    assert {name: type(module).__name__ for name, module in twin.named_modules()} == swapped_types
    assert twin.model.layers[0] is not model.model.layers[0]
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, expected, rtol=1e-4, atol=1e-5)
    # the copy's swap is its own: unswap puts its own originals back
    unswap(twin)
    assert type(twin.model.layers[0].self_attn).__name__ == "Qwen3Attention"
    assert type(model.model.layers[0].self_attn).__name__ == "RopeAttention"
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, expected, rtol=1e-4, atol=1e-5)


def test_a_swapped_moe_model_pickles():
    """An experts block's routed gate was a pair of lambdas on the module: a swapped Qwen3-MoE did not pickle."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                                      head_dim=16, num_experts=4, num_experts_per_tok=2)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    assert "swiglu" in {row[2] for row in swap(model).swapped}
    assert type(model.model.layers[0].mlp.experts).__name__ == "GatedExperts"
    ids = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    twin = pickle.loads(pickle.dumps(model))
    assert type(twin.model.layers[0].mlp.experts).__name__ == "GatedExperts"
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, model(ids).logits)


def test_a_model_under_an_installed_plan_pickles_too():
    # ab_test's plans are not kept on the model: each stand-in carries what rebuilds it
    model = _qwen3()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = model(ids).logits
    with plan_swaps(model, ["rope", "residual_rms_norm"]).installed():
        twin = pickle.loads(pickle.dumps(model))
    assert type(twin.model.layers[1]).__name__ == "ResidualNormLayer"
    assert type(twin.model.layers[1].self_attn).__name__ == "RopeAttention"
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, expected, rtol=1e-4, atol=1e-5)
