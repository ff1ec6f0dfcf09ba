"""The strict gate is strict on bf16 models, a correct swap still passes, and a precision change is
judged by its numeric cost within the user's tolerance."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ab_swaps import NOOP, WRONG, needs_kernels
from ab_workloads import llama_train_adamw, mlp
from profiler_svc.ab import ab_test, fixes
from profiler_svc.kernels import SwapEntry

transformers = pytest.importorskip("transformers")
QUICK = dict(rounds=2, warmup=0)


def tiny_llama(dtype, vocab=256):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      attn_implementation="sdpa", use_cache=False)
    model = transformers.LlamaForCausalLM(config).to(dtype)
    ids = torch.randint(0, vocab, (2, 32))
    return model, {"input_ids": ids, "labels": ids}


def _mlp(dtype, train):
    model, (x,) = mlp()
    model = model.to(dtype)
    x = x.to(dtype)
    if not train:
        return model, (x,), None
    target = torch.randint(0, 10, (x.shape[0],))
    return model, (x,), lambda out: F.cross_entropy(out.float(), target)


def _failed(result):
    return {t.name for t in result.parity if not t.passed}


@pytest.mark.parametrize("train", [False, True])
@pytest.mark.parametrize("factory", ["mlp", "llama"])
def test_one_percent_wrong_kernel_fails_on_a_bf16_model(factory, train):
    """Every Linear's output times 1.01: close to bf16's own rounding, and still a bug."""
    if factory == "mlp":
        model, inputs, loss_fn = _mlp(torch.bfloat16, train)
    else:
        model, inputs = tiny_llama(torch.bfloat16)
        loss_fn = None
    result = ab_test(model, inputs, [WRONG], train=train, loss_fn=loss_fn, **QUICK)
    assert result.verdict == "parity_failed", [(t.name, t.b_rms_rel, t.allowed_rms_rel) for t in result.parity]
    failed = _failed(result)
    outputs = {t.name for t in result.parity if t.name.startswith("output")}
    assert failed & outputs  # the forward alone gives it away
    if train:
        assert any(name.startswith("grad.") for name in failed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_same_arithmetic_passes_with_eager_error_and_spread(dtype):
    model, inputs = tiny_llama(dtype)
    result = ab_test(model, inputs, [NOOP], train=True, **QUICK)
    assert result.parity_passed and all(t.gate == "strict" for t in result.parity)
    for t in result.parity:
        assert t.b_rms_rel == t.a_rms_rel and t.spread_rms_rel >= 0
    loss = next(t for t in result.parity if t.name == "loss")
    # the float32 loss of a bf16 model is held to the spread bf16 parameters give it, not to 4 bf16 units
    assert loss.allowed_rms_rel < 4 * torch.finfo(torch.bfloat16).eps


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("train", [False, True])
def test_real_swaps_pass_the_strict_gate(dtype, train):
    model, inputs = tiny_llama(dtype)
    result = ab_test(model, inputs, ["rms_norm", "swiglu"], train=train, **QUICK)
    assert {row["swap"] for row in result.swapped} == {"rms_norm", "swiglu"}
    assert result.parity_passed, [(t.name, t.b_rms_rel, t.allowed_rms_rel, t.b_max_abs, t.allowed_abs)
                                  for t in result.parity if not t.passed]


def test_precision_fix_reports_its_numeric_cost_and_tolerance():
    model, inputs = tiny_llama(torch.float32)
    result = ab_test(model, inputs, fixes=["bf16_autocast"], train=True, **QUICK)
    assert result.parity_passed and result.fixes == ["bf16_autocast"]
    assert {t.gate for t in result.parity} == {"cost"}  # no swap or exact fix: nothing for the strict gate
    cost = result.numeric_cost
    # bf16 costs orders of magnitude more than eager fp32's own error, and far less than 100%
    assert 1e-4 < cost["worst_rms_rel"] < 0.5 and cost["worst_rms_rel"] > 100 * cost["eager_rms_rel"]
    assert {"output", "loss", "grad"} <= set(cost["by_kind"])
    assert "numeric cost vs fp64" in result.summary()

    strict = ab_test(model, inputs, fixes=["bf16_autocast"], train=True, max_rel_error=cost["worst_rms_rel"] / 2,
                     **QUICK)
    assert strict.verdict == "parity_failed" and strict.timing is None
    assert any(not t.passed and t.gate == "cost" for t in strict.parity)


def test_swap_with_a_precision_fix_is_judged_against_that_precision():
    """A wrong kernel under autocast fails against autocast alone; the same arithmetic passes."""
    model, inputs = tiny_llama(torch.float32)
    wrong = ab_test(model, inputs, [WRONG], fixes=["bf16_autocast"], train=True, **QUICK)
    assert wrong.verdict == "parity_failed"
    assert all(t.passed for t in wrong.parity if t.gate == "cost")
    assert any(not t.passed for t in wrong.parity if t.gate == "strict")
    same = ab_test(model, inputs, [NOOP], fixes=["bf16_autocast"], train=True, **QUICK)
    assert same.parity_passed and {t.gate for t in same.parity} == {"cost", "strict"}


class GroupedExperts(torch.nn.Module):
    """Two experts through torch._grouped_mm, as Mixtral's and Qwen3-MoE's experts call it: it has no
    float64 kernel."""

    def __init__(self, width=16):
        super().__init__()
        self.up = torch.nn.Linear(width, width)
        self.experts = torch.nn.Parameter(torch.randn(2, width, width) / width ** 0.5)

    def forward(self, x):
        h = self.up(x)
        offsets = torch.tensor([x.shape[0] // 2, x.shape[0]], dtype=torch.int32)
        return torch._grouped_mm(h, self.experts, offs=offsets)


def test_reference_falls_back_for_an_op_without_float64():
    torch.manual_seed(0)
    model, x = GroupedExperts(), torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="got Double"):
        torch._grouped_mm(x.double(), model.experts.detach().double(), offs=torch.tensor([4, 8], dtype=torch.int32))
    result = ab_test(model, (x,), [NOOP], **QUICK)
    assert result.reference_fallbacks == [{"op": "aten::_grouped_mm", "dtype": "float32"}]
    assert "aten::_grouped_mm has no float64 kernel here; ran it in float32" in result.summary()
    # the Linear before it is still judged against a float64 run: eager's error is a float32 one, not zero
    output = next(t for t in result.parity if t.name == "output")
    assert result.parity_passed and 0 < output.a_rms_rel < 1e-5


class Router(torch.nn.Module):
    """An MoE router (Mixtral's TopKRouter): softmax of the logits in fp32, the top k experts."""

    def __init__(self, width, experts, k):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, width) / width ** 0.5)
        self.k = k

    def forward(self, x):
        probs = torch.softmax(torch.nn.functional.linear(x, self.weight).float(), -1)
        top, index = torch.topk(probs, self.k, dim=-1)
        return top / top.sum(-1, keepdim=True), index


class LowestRouter(Router):
    """A broken router: the k experts it scores lowest."""

    def forward(self, x):
        probs = torch.softmax(torch.nn.functional.linear(x, self.weight).float(), -1)
        top, index = torch.topk(probs, self.k, dim=-1, largest=False)
        return top / top.sum(-1, keepdim=True), index


class ToyMoE(torch.nn.Module):
    """Tokens routed to 2 of 4 experts; experts 1 and 2 score within bf16's rounding of each other on every
    token, so bf16 and fp64 pick differently on some tokens."""

    def __init__(self, width=32, experts=4):
        super().__init__()
        self.router = Router(width, experts, 2)
        with torch.no_grad():
            self.router.weight[2] = self.router.weight[1] * (1 + 1e-3)
        self.experts = torch.nn.Parameter(torch.randn(experts, width, width) / width ** 0.5)
        self.head = torch.nn.Linear(width, 8)

    def forward(self, x):
        weights, index = self.router(x)
        y = torch.einsum("nd,nkde->nke", x, self.experts[index])
        return self.head((weights.to(x.dtype)[..., None] * y).sum(1))


def _lowest_router(router):
    new = LowestRouter(router.weight.shape[1], router.weight.shape[0], router.k)
    new.weight = router.weight
    return new


LOWEST = SwapEntry(name="test_lowest_router", summary="an MoE router picking its lowest-scored experts (wrong)",
                   matches=lambda m: type(m) is Router, replace=_lowest_router,
                   example_inputs=lambda m: (torch.randn(4, m.weight.shape[1], dtype=m.weight.dtype),))


def _moe(train):
    torch.manual_seed(0)
    model, x = ToyMoE().to(torch.bfloat16), torch.randn(256, 32).to(torch.bfloat16)
    target = torch.randint(0, 8, (256,))
    return model, (x,), (lambda out: F.cross_entropy(out.float(), target)) if train else None


@pytest.mark.parametrize("train", [False, True])
def test_a_routed_model_is_judged_on_its_own_choices(train):
    """Against an fp64 run that routes by its own ranking, eager bf16 looks wrong by whole experts on the
    tokens where the near-tie flips; against one that takes eager's choices, by its rounding alone."""
    model, inputs, loss_fn = _moe(train)
    with torch.no_grad():
        own = torch.topk(torch.softmax(F.linear(inputs[0].double(), model.router.weight.double()), -1), 2).indices
        bf16 = model.router(inputs[0])[1]
    assert (own.sort(-1).values != bf16.sort(-1).values).any(-1).sum() > 0  # some tokens flip
    result = ab_test(model, inputs, [NOOP], train=train, loss_fn=loss_fn, **QUICK)
    assert result.parity_passed, [(t.name, t.b_rms_rel, t.allowed_rms_rel) for t in result.parity if not t.passed]
    output = next(t for t in result.parity if t.name == "output")
    assert output.a_rms_rel < 4 * torch.finfo(torch.bfloat16).eps  # rounding, not a whole expert's output
    choices = next(t for t in result.parity if t.name == "choices.topk")
    assert 0 < choices.a_max_abs < torch.finfo(torch.bfloat16).eps  # flipped, by less than a rounding unit
    assert "each run judged against fp64 taking that run's own top-k choices" in result.summary()


def test_a_router_picking_the_wrong_experts_fails_parity():
    model, inputs, loss_fn = _moe(True)
    result = ab_test(model, inputs, [LOWEST], train=True, loss_fn=loss_fn, **QUICK)
    assert result.verdict == "parity_failed"
    choices = next(t for t in result.parity if t.name == "choices.topk")
    assert not choices.passed and choices.b_max_abs > 0.1


def test_reference_failure_names_the_op_and_the_cause():
    from profiler_svc.errors import UserError

    model, (x,) = mlp()
    with pytest.raises(UserError, match=r"float64 reference run failed: aten::\w+ got float32 and float64 inputs"
                                        r".*a step callable must build its floating inputs in the model's dtype"):
        ab_test(model, lambda m: m(x), [NOOP], **QUICK)  # x stays float32 while the reference is float64


class _LargerStep(fixes.Change):
    """The optimizer's learning rate times 1.01 while installed: a wrong optimizer, close to right."""

    def __init__(self, optimizer):
        self.optimizer, self.saved = optimizer, [g["lr"] for g in optimizer.param_groups]

    def install(self):
        for group in self.optimizer.param_groups:
            group["lr"] *= 1.01

    def remove(self):
        for group, lr in zip(self.optimizer.param_groups, self.saved):
            group["lr"] = lr


def test_the_optimizer_step_is_judged_apart_from_the_gradients(monkeypatch):
    """Parameters after the step are compared with an fp64 step from each run's own gradients: SDPA's
    gradients (within their gate) pass through AdamW, whose update amplifies a gradient's rounding near
    eps, while an optimizer 1% off fails on the parameters it steps."""
    monkeypatch.setattr(fixes, "_REGISTRY", fixes._REGISTRY + (
        fixes.FixEntry("test_larger_step", "lr times 1.01 (deliberately wrong)", lambda model, opt: _LargerStep(opt)),))
    model, inputs, _, optimizer = llama_train_adamw()  # some of its k_proj gradients are within 10x of eps
    right = ab_test(model, inputs, [], fixes=["sdpa"], train=True, optimizer=optimizer, **QUICK)
    assert right.parity_passed, [(t.name, t.b_rms_rel, t.allowed_rms_rel) for t in right.parity if not t.passed]
    wrong = ab_test(model, inputs, [], fixes=["test_larger_step"], train=True, optimizer=optimizer, **QUICK)
    failed = _failed(wrong)
    assert failed and all(name.startswith("param.") for name in failed)


def test_a_tensor_eager_gets_wrong_by_half_its_norm_is_held_to_twice_that():
    """Eager's BatchNorm gradients on a random ResNet-50 are >= 50% rounding noise: channels-last draws
    other noise there (0.93 against eager's 0.87, nudged spread 0.007), which says nothing of a kernel."""
    from kernels.parity import Error, judge_strict
    ref = ((512,), 1e-3)
    a, spread = Error(1e-3, 0.9, 0.87), [Error(1e-3, 0.9, 0.877)]
    other_noise = judge_strict("grad.bn.weight", ref, torch.bfloat16, a, spread, Error(1.1e-3, 1.0, 0.93), 4.0)
    assert other_noise.passed and other_noise.gate == "ill_conditioned"
    garbage = judge_strict("grad.bn.weight", ref, torch.bfloat16, a, spread, Error(5e-3, 5.0, 1.9), 4.0)
    assert not garbage.passed
    lost = judge_strict("grad.bn.weight", ref, torch.bfloat16, a, spread, Error(float("inf"), float("inf"), 0.5), 4.0)
    assert not lost.passed
    # below the threshold the strict gate holds: the same excess fails where eager is accurate
    accurate = Error(1e-5, 0.01, 0.01)
    strict = judge_strict("output", ref, torch.bfloat16, accurate, [Error(1e-5, 0.01, 0.0101)],
                          Error(1e-5, 0.01, 0.07), 4.0)
    assert strict.gate == "strict" and not strict.passed


class _Shared(list):
    """A list the fp64 reference's deep copy of the model shares with the model."""

    def __deepcopy__(self, memo):
        return self


class FloatSixtyFourMemory(torch.nn.Module):
    """The MLP, but its float64 run has the memory for at most `fits` samples: what the reference meets on a large
    model and batch (Mixtral's training step at 4x2048 tokens on an H100). `seen` records each run's batch."""

    def __init__(self, fits):
        super().__init__()
        self.inner, self.fits, self.seen = mlp()[0], fits, _Shared()

    def forward(self, x):
        self.seen.append((x.dtype, x.shape[0]))
        if x.dtype == torch.float64 and x.shape[0] > self.fits:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.")
        return self.inner(x)


def test_parity_takes_part_of_the_batch_where_float64_runs_out_of_memory():
    model, x = FloatSixtyFourMemory(fits=16), mlp()[1][0]
    result = ab_test(model, (x,), [NOOP], **QUICK)
    assert result.parity_passed and result.verdict != "parity_failed"
    assert {"op": "inputs", "note": "parity checked on the first 16 of the batch's 64 samples: the float64 "
                                    "reference ran out of GPU memory on more"} in result.reference_fallbacks
    float64_batches = [n for dtype, n in model.seen if dtype == torch.float64]
    assert float64_batches[:3] == [64, 32, 16] and set(float64_batches[2:]) == {16}
    assert (torch.float32, 64) in model.seen  # the timed rounds ran the whole batch
    assert "fp64 reference: inputs: parity checked on the first 16" in result.summary()


@pytest.mark.parametrize("inputs, message", [
    (lambda m: m(torch.randn(64, 128, dtype=next(m.parameters()).dtype)),
     ": .*; give ab_test inputs as a tensor, args tuple or kwargs dict"),
    ((torch.randn(1, 128),), " on one sample: .*; give ab_test a shorter input"),
])
def test_parity_out_of_memory_it_cannot_split_is_one_clear_error(inputs, message):
    from profiler_svc.errors import UserError

    with pytest.raises(UserError, match="the parity check ran out of GPU memory" + message):
        ab_test(FloatSixtyFourMemory(fits=0), inputs, [NOOP], **QUICK)


def test_a_spread_run_without_the_tensor_does_not_lift_the_allowance():
    """A nudged run in which an MoE expert got no tokens has no gradient for it (MISSING): that run says nothing
    of eager's spread, and must not make the allowance infinite, which would pass a wrong or lost tensor."""
    from kernels.parity import MISSING, Error, judge_strict
    ref = ((512,), 1.0)
    a, nudged = Error(1e-3, 1e-3, 0.01), Error(1e-3, 1e-3, 0.0101)
    wrong = judge_strict("grad.experts.3.w1", ref, torch.bfloat16, a, [nudged, MISSING], Error(0.1, 0.1, 0.05), 4.0)
    assert not wrong.passed and wrong.allowed_rms_rel < 0.02
    lost = judge_strict("grad.experts.3.w1", ref, torch.bfloat16, a, [MISSING], MISSING, 4.0)
    assert not lost.passed
    same = judge_strict("grad.experts.3.w1", ref, torch.bfloat16, a, [nudged, MISSING], Error(1e-3, 1e-3, 0.0102), 4.0)
    assert same.passed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn])
def test_spread_runs_nudge_each_parameter_by_a_few_of_its_rounding_units(dtype):
    """Up to NUDGE_UNITS rounding units, relative (so most values move, by more than one unit where the dtype
    allows), never more than NUDGE_MAX: 8 units of an fp8 type would zero weights or flip their signs."""
    from profiler_svc.ab.runner import NUDGE_MAX, NUDGE_UNITS, nudged_copy
    p = (0.5 + torch.rand(4096, generator=torch.Generator().manual_seed(0))).to(dtype)
    nudged = nudged_copy(p, torch.Generator().manual_seed(1))
    moved = nudged.double() / p.double() - 1
    ulp = torch.finfo(dtype).eps  # one rounding back to the dtype, relative, at most
    assert moved.abs().max() <= min(NUDGE_UNITS * ulp, NUDGE_MAX) + ulp
    assert bool((nudged.double() > 0).all())  # none zeroed, none of its sign flipped
    if NUDGE_UNITS * ulp <= NUDGE_MAX:
        assert (moved != 0).float().mean() > 0.5 and moved.abs().max() > 2 * ulp  # most move, some by units


def test_a_routed_model_with_an_optimizer_judges_every_variant_from_the_same_parameters():
    """Each run of a routed model has its own fp64 run; the optimizer step of one stepped the reference's
    parameters for the next, so B was judged one step ahead and a 1%-wrong head passed."""
    model, inputs, loss_fn = _moe(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    same = ab_test(model, inputs, [NOOP], train=True, loss_fn=loss_fn, optimizer=optimizer, **QUICK)
    assert same.parity_passed, [(t.name, t.b_rms_rel, t.allowed_rms_rel) for t in same.parity if not t.passed]
    wrong = ab_test(model, inputs, [WRONG], train=True, loss_fn=loss_fn, optimizer=optimizer, **QUICK)
    assert wrong.verdict == "parity_failed" and "output" in _failed(wrong)


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    note: str = "dataclass"


class _Wrapped(torch.nn.Module):
    """The MLP's output in a dataclass, as None, or in an object parity cannot see into."""

    def __init__(self, kind):
        super().__init__()
        self.inner, self.kind = mlp()[0], kind

    def forward(self, x):
        y = self.inner(x)
        return {"dataclass": _Out(y), "none": None, "object": object()}[self.kind]


def test_a_dataclass_output_is_compared_field_by_field():
    x = mlp()[1][0]
    result = ab_test(_Wrapped("dataclass"), (x,), [WRONG], **QUICK)
    assert [t.name for t in result.parity] == ["output.logits"] and result.verdict == "parity_failed"


@pytest.mark.parametrize("kind", ["none", "object"])
def test_an_output_without_a_floating_tensor_is_a_user_error(kind):
    """No loss, no gradients and no output tensor: nothing would be compared, and all([]) passed."""
    from profiler_svc.errors import UserError

    with pytest.raises(UserError, match="nothing to compare: the model's output holds no tensor"):
        ab_test(_Wrapped(kind), (mlp()[1][0],), [WRONG], **QUICK)


class _Classifier(torch.nn.Module):
    """Logits and their argmax: bf16 rounding flips the argmax of near-tied logits, which fp64 does not."""

    def __init__(self, width=64, classes=2000):
        super().__init__()
        self.norm = torch.nn.RMSNorm(width)
        self.head = torch.nn.Linear(width, classes)

    def forward(self, x):
        logits = self.head(self.norm(x))
        return logits, logits.argmax(-1)


class _ShiftedLinear(torch.nn.Module):
    """The linear map plus 0.5 on the first 100 outputs: the argmax moves to them."""

    def __init__(self, linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)
        return torch.cat([y[..., :100] + 0.5, y[..., 100:]], -1)


SHIFTED = SwapEntry(name="test_shifted_linear", summary="moves the argmax (wrong)", replace=_ShiftedLinear,
                    matches=lambda m: type(m) is torch.nn.Linear,
                    example_inputs=lambda m: (torch.randn(4, m.in_features, dtype=m.weight.dtype),))


def test_integer_outputs_are_judged_by_how_often_they_differ_from_fp64():
    """An integer output's error was 0 or infinite: eager's argmax differs from fp64's somewhere, so every swap
    failed. It is judged by its share of differing elements, within eager's share and its spread."""
    torch.manual_seed(0)
    model, x = _Classifier().to(torch.bfloat16), torch.randn(4, 64, 64).to(torch.bfloat16)
    same = ab_test(model, (x,), [NOOP], **QUICK)
    argmax = next(t for t in same.parity if t.name == "output[1]")
    assert same.parity_passed and argmax.gate == "mismatch" and 0 < argmax.a_rms_rel < 0.1
    assert "integer or bool tensors, judged by the share of elements that differ" in same.summary()
    wrong = ab_test(model, (x,), [SHIFTED], **QUICK)
    argmax = next(t for t in wrong.parity if t.name == "output[1]")
    assert not argmax.passed and argmax.b_rms_rel > 0.3


class _ArgmaxOnly(_Classifier):
    def forward(self, x):
        return super().forward(x)[1]


def test_an_output_of_integers_alone_is_judged_too():
    """An inference model returning only its argmax was refused as "nothing to compare", though the mismatch gate
    judges exactly that."""
    torch.manual_seed(0)
    model, x = _ArgmaxOnly().to(torch.bfloat16), torch.randn(4, 64, 64).to(torch.bfloat16)
    same = ab_test(model, (x,), [NOOP], **QUICK)
    assert same.parity_passed and [t.gate for t in same.parity] == ["mismatch"]
    assert not ab_test(model, (x,), [SHIFTED], **QUICK).parity_passed


def test_a_shape_error_is_the_models_own_not_the_references():
    """Only an op without a float64 kernel is retried in lower precisions; a shape error is raised as the model
    raises it, not as a failure of the float64 reference."""
    model = mlp()[0]
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        ab_test(model, (torch.randn(8, 16),), [NOOP], **QUICK)


class _Fp32Router(torch.nn.Module):
    """A bf16 body with its router kept in fp32, fed `h.float()`, as MoE models keep routers."""

    def __init__(self, width=32):
        super().__init__()
        self.body = torch.nn.Linear(width, width).to(torch.bfloat16)
        self.router = torch.nn.Linear(width, 4)

    def forward(self, x):
        h = self.body(x)
        return h, self.router(h.float())


def test_a_model_that_mixes_precisions_gets_its_lower_precision_inputs_upcast_in_the_reference():
    """In the fp64 copy, `h.float()` meets the router's float64 weight: the float32 input is upcast, and said."""
    torch.manual_seed(0)
    result = ab_test(_Fp32Router(), (torch.randn(8, 32).to(torch.bfloat16),), [NOOP], **QUICK)
    assert result.parity_passed
    assert {"op": "aten::addmm", "note": "the model mixes float32 with float64 here; its float32 inputs were upcast "
                                         "to float64"} in result.reference_fallbacks


def test_a_complex_output_is_judged_by_its_error_not_by_mismatches():
    """Complex tensors are not floating point in torch's sense: they went to the integer outputs' mismatch gate,
    where a B three times off passed."""
    from profiler_svc.kernels import parity
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(64, dtype=torch.complex128, generator=gen)
    a = parity.measure((ref * (1 + 1e-4)).to(torch.complex64), ref)
    spread = [parity.measure((ref * (1 + 2e-4)).to(torch.complex64), ref)]
    wrong = parity.judge_strict("output", ref, torch.complex64, a, spread, parity.measure((ref * 3).to(torch.complex64), ref), 4.0)
    assert wrong.gate != "mismatch" and not wrong.passed


def test_the_reference_keeps_a_second_copy_of_its_parameters_only_for_an_optimizer_and_on_the_cpu():
    """Every reference run starts from the same parameters; only an optimizer's step moves them, and the copy that
    puts them back held as much memory as the fp64 parameters themselves, on their device."""
    from profiler_svc.ab import runner
    model, x = nn.Linear(8, 8), torch.randn(2, 8)
    call = runner._caller((x,))
    plain = runner._Reference(model, (x,), runner._Step(call, True, None, None, list(model.named_parameters())), 0)
    assert plain.initial is None
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    stepped = runner._Reference(model, (x,), runner._Step(call, True, None, sgd, list(model.named_parameters())), 0)
    assert stepped.initial and all(t.device.type == "cpu" and t.dtype == torch.float64 for t in stepped.initial)
