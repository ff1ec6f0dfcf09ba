"""The fix registry on CPU-sized models: each fix changes what it says while installed, and removing it
leaves the model, its parameters, the optimizer and the global flags exactly as they were."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from profiler_svc.ab.fixes import (UnknownFixError, available_fixes, fix_summaries, plan_fixes)
from profiler_svc.agent.metadata import numerics
from profiler_svc.fix_names import FIX_NAMES

transformers = pytest.importorskip("transformers")


def llama(vocab=250, attn="eager"):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      attn_implementation=attn, use_cache=False, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


def gpt2(vocab=250):
    """Tied embedding and LM head: one Parameter for both."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=4, vocab_size=vocab, n_positions=32,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, vocab, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))).mean((2, 3)))


def convnet():
    torch.manual_seed(0)
    return ConvNet(), (torch.randn(2, 3, 8, 8),)


def _snapshot(model, optimizer):
    return {
        "modules": list(model.named_modules()),
        # the same Parameter over the same memory, layout and values; the same .grad tensor
        "params": [(n, p, _where(p), p.detach().clone(), p.grad) for n, p in model.named_parameters()],
        "buffers": [(n, b, b.detach().clone(), _where(b)) for n, b in model.named_buffers()],
        "modes": [m.training for m in model.modules()],
        "dicts": [(m, set(m.__dict__)) for m in model.modules()],
        "configs": [(c, copy.deepcopy(c.__dict__)) for c in {id(m.config): m.config for m in model.modules()
                                                             if hasattr(m, "config")}.values()],
        "hooks": [(m, len(m._forward_pre_hooks), len(m._forward_hooks)) for m in model.modules()],
        "optimizer": None if optimizer is None else (
            [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            copy.deepcopy(optimizer.state_dict()["state"])),
        "flags": numerics(),
    }


def _where(t):
    return t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride()


def _assert_same(model, optimizer, before):
    after = _snapshot(model, optimizer)
    assert [(n, id(m)) for n, m in after["modules"]] == [(n, id(m)) for n, m in before["modules"]]
    for (n, p, where, value, grad), (n0, p0, where0, value0, grad0) in zip(after["params"], before["params"]):
        assert n == n0 and p is p0 and where == where0 and grad is grad0 and torch.equal(value, value0), n
    for (n, b, value, stride), (n0, b0, value0, stride0) in zip(after["buffers"], before["buffers"]):
        assert n == n0 and b is b0 and stride == stride0 and torch.equal(value, value0), n
    assert after["modes"] == before["modes"] and after["hooks"] == before["hooks"]
    assert [(id(m), keys) for m, keys in after["dicts"]] == [(id(m), keys) for m, keys in before["dicts"]]
    assert [c.__dict__ for c, _ in after["configs"]] == [d for _, d in before["configs"]]
    if optimizer is not None:
        groups, state = after["optimizer"]
        assert groups == before["optimizer"][0]
        assert state.keys() == before["optimizer"][1].keys()
        for key, values in state.items():
            for name, value in values.items():
                assert torch.equal(value, before["optimizer"][1][key][name]), (key, name)
    assert after["flags"] == before["flags"]


def _train_step(model, inputs, optimizer, call):
    out = call(model)
    loss = out.loss if hasattr(out, "loss") else out.float().square().mean()
    loss.backward()
    if optimizer is not None:
        optimizer.step()
    return out


CASES = {
    "tf32": llama, "bf16_autocast": llama, "sdpa": llama, "fused_optimizer": llama, "bundled_adamw": llama,
    "pad_vocab": llama,
    "channels_last": convnet, "cudnn_benchmark": convnet, "use_cache": llama,
}


def test_one_list_of_names():
    assert tuple(available_fixes()) == FIX_NAMES and set(fix_summaries()) == set(FIX_NAMES)
    with pytest.raises(UnknownFixError, match="unknown fix 'tf33'; available: tf32"):
        plan_fixes(nn.Linear(2, 2), ["tf33"])


@pytest.mark.parametrize("name", sorted(CASES))
def test_fix_applies_and_undoes_exactly(name):
    model, inputs = CASES[name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    call = (lambda m: m(**inputs)) if isinstance(inputs, dict) else (lambda m: m(*inputs))
    _train_step(model, inputs, optimizer, call)  # the optimizer has state; the parameters have .grad
    model.train()
    before = _snapshot(model, optimizer)
    plan = plan_fixes(model, [name], optimizer=optimizer)
    assert plan.applied == [name] and not plan.skipped, plan.skipped
    for _ in range(2):  # installed and removed twice: ab_test toggles a plan between rounds
        with plan.installed():
            flags = numerics()
            _train_step(model, inputs, optimizer, plan.wrap(call))
            if name == "tf32":
                assert flags["allow_tf32_matmul"] is True and flags["float32_matmul_precision"] == "high"
            if name == "cudnn_benchmark":
                assert flags["cudnn_benchmark"] is True
            if name == "sdpa":
                assert model.config._attn_implementation == "sdpa"
            if name == "fused_optimizer":
                assert all(g["fused"] for g in optimizer.param_groups)
            if name == "bundled_adamw":
                assert "step" in optimizer.__dict__  # this instance's step is the kernel's
            if name == "pad_vocab":
                head = model.lm_head.head.weight
                assert head.shape[0] == 250 and head.untyped_storage().nbytes() == 256 * 64 * 4
            if name == "channels_last":
                assert model.conv.weight.is_contiguous(memory_format=torch.channels_last)
            if name == "use_cache":
                assert model.config.use_cache is True
        # the optimizer stepped in B: put the values back to compare the rest exactly
        with torch.no_grad():
            for _, p, _, value, _ in before["params"]:
                p.copy_(value)
            for p, saved in zip(optimizer.state.values(), before["optimizer"][1].values()):
                for key, value in saved.items():
                    p[key].copy_(value)
        for _, p, _, _, grad in before["params"]:
            p.grad = grad
        for _, b, value, _ in before["buffers"]:
            b.copy_(value)
        _assert_same(model, optimizer, before)


def test_autocast_computes_in_bf16():
    model, inputs = llama()
    plan = plan_fixes(model, ["bf16_autocast"])
    with plan.installed():
        out = plan.wrap(lambda m: m(**inputs))(model)
    assert out.logits.dtype == torch.bfloat16


@pytest.mark.parametrize("factory", [llama, gpt2])
def test_pad_vocab_keeps_outputs_loss_and_gradients(factory):
    model, inputs = factory()
    out = model(**inputs)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    plan = plan_fixes(model, ["pad_vocab"])
    assert "250 padded to 256" in plan.changes[0][1].note
    with plan.installed():
        padded = model(**inputs)
        padded.loss.backward()
    assert padded.logits.shape == out.logits.shape
    torch.testing.assert_close(padded.logits, out.logits)
    torch.testing.assert_close(padded.loss, out.loss)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], msg=n)


@pytest.mark.parametrize("name, factory, reason", [
    ("pad_vocab", lambda: llama(vocab=256), "already a multiple of 64"),
    ("sdpa", lambda: llama(attn="sdpa"), "already runs through sdpa"),
    ("sdpa", convnet, "no Hugging Face config"),
    ("fused_optimizer", llama, "has no optimizer"),
    ("bundled_adamw", llama, "has no optimizer"),
    ("cuda_graphs", llama, "need the model on a CUDA device"),
    ("channels_last", llama, "no 4-d weights"),
    ("cudnn_benchmark", llama, "no convolution"),
    ("sdpa_backends", llama, "not on a CUDA device"),
    ("use_cache", lambda: (transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=64)), None),
     "already on"),
    ("use_cache", convnet, "no Hugging Face config"),
    ("bf16_autocast", lambda: (llama()[0].to(torch.bfloat16), None), "no float32 parameters"),
])
def test_not_applicable_says_why(name, factory, reason):
    model, _ = factory()
    before = _snapshot(model, None)
    plan = plan_fixes(model, [name])
    assert plan.applied == [] and plan.skipped[0][0] == name and reason in plan.skipped[0][1]
    _assert_same(model, None, before)


def test_bundled_adamw_says_which_optimizer_it_does_not_step():
    model, _ = llama()
    plan = plan_fixes(model, ["bundled_adamw"], optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    assert plan.applied == [] and "SGD is not torch.optim.AdamW" in plan.skipped[0][1]
    plan = plan_fixes(model, ["bundled_adamw"], optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True))
    assert plan.applied == [] and "amsgrad=True" in plan.skipped[0][1]


def test_sdpa_backends_allows_the_fused_backends_inside_the_forward_only():
    """The user's code turned flash and memory-efficient SDPA off: the fix's forward runs with them allowed, and
    the flags are the user's again after it."""
    from profiler_svc.ab.fixes import _FusedSdpaBackends
    cuda = torch.backends.cuda
    seen = []
    cuda.enable_flash_sdp(False)
    cuda.enable_mem_efficient_sdp(False)
    try:
        _FusedSdpaBackends(["flash", "memory-efficient"]).wrap(
            lambda model: seen.append((cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled())))(None)
        assert seen == [(True, True)]
        assert (cuda.flash_sdp_enabled(), cuda.mem_efficient_sdp_enabled()) == (False, False)
    finally:
        cuda.enable_flash_sdp(True)
        cuda.enable_mem_efficient_sdp(True)


def test_flags_already_on_are_not_applicable():
    model, _ = convnet()
    torch.backends.cudnn.benchmark = True
    try:
        assert "already on" in plan_fixes(model, ["cudnn_benchmark"]).skipped[0][1]
    finally:
        torch.backends.cudnn.benchmark = False


def test_use_cache_skips_the_packed_sequence_check(monkeypatch):
    """Without a cache or an attention mask, transformers checks the position ids for packed sequences on the host
    in every forward (a GPU sync); with the fix installed, the forward has a cache and skips the check."""
    import transformers.masking_utils as masking
    calls = []
    check = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda *a, **k: calls.append(1) or check(*a, **k))
    model, inputs = llama(attn="sdpa")
    plan = plan_fixes(model, ["use_cache"])
    model(**inputs).loss.backward()
    with plan.installed():
        model(**inputs).loss.backward()
    model(**inputs)
    assert calls == [1, 1]  # before and after the fix, not while installed
