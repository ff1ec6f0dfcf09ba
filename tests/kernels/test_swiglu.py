import pytest
import torch
import torch.nn.functional as F
from kernel_numerics import assert_no_worse
from torch import nn

from profiler_svc.kernels import geglu, swap, swapped, swiglu, unswap
from profiler_svc.kernels._elementwise import GELU_TANH, SILU
from profiler_svc.kernels.swiglu import SWAP, GatedMLP, GateUpMLP

transformers = pytest.importorskip("transformers")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(gate, up):  # also eager: HF's act_fn(gate_proj(x)) * up_proj(x)
    return F.silu(gate) * up


def inputs(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(3 * torch.randn(shape, generator=gen, dtype=torch.float64)).requires_grad_() for _ in range(2)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(37, 1000), (64, 1), (1,), (2, 17001)])
def test_numerics_no_worse_than_eager(dtype, shape):
    assert_no_worse(swiglu, {"F.silu*up": reference}, inputs(shape, 1), reference, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_views_of_a_fused_gate_up_projection(dtype):
    # gate and up as column halves of one [M, 2N] tensor: non-contiguous views, copied inside
    halves = lambda f: lambda gu: f(*gu.chunk(2, dim=-1))  # noqa: E731
    gen = torch.Generator().manual_seed(2)
    gu = (3 * torch.randn(37, 2 * 333, generator=gen, dtype=torch.float64)).requires_grad_()
    assert_no_worse(halves(swiglu), {"F.silu*up": halves(reference)}, [gu], halves(reference), dtype)


def test_empty_and_bad_input():
    assert swiglu(torch.empty(0, 8), torch.empty(0, 8)).shape == (0, 8)
    with pytest.raises(ValueError, match="same shape"):
        swiglu(torch.randn(4, 8), torch.randn(4, 1))
    with pytest.raises(TypeError, match="differ in dtype"):
        swiglu(torch.randn(4, 8), torch.randn(4, 8, dtype=torch.float64))
    with pytest.raises(TypeError, match="floating-point"):
        swiglu(torch.ones(4, 8, dtype=torch.int32), torch.ones(4, 8, dtype=torch.int32))


def tiny(model_name, **extra):
    torch.manual_seed(0)
    cfg = getattr(transformers, f"{model_name}Config")(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=128, **extra,
    )
    return getattr(transformers, f"{model_name}ForCausalLM")(cfg).eval()


@pytest.mark.parametrize("model_name", ["Llama", "Mistral", "Qwen2"])
def test_gated_mlps_swapped_shared_and_restored(model_name):
    model = tiny(model_name)
    originals = {n: m for n, m in model.named_modules() if n.endswith(".mlp")}
    ids = torch.randint(0, 128, (2, 7))
    expected_loss = model(ids, labels=ids).loss
    expected_loss.backward()
    expected_grads = {n: p.grad.clone() for n, p in model.named_parameters() if "mlp" in n}
    model.zero_grad()

    with swapped(model, ["swiglu"]) as report:
        assert sorted(row[0] for row in report.swapped) == sorted(originals) and len(originals) == 2
        assert report.skipped == [] and all(row[2] == "swiglu" for row in report.swapped)
        for name, orig in originals.items():
            new = model.get_submodule(name)
            assert isinstance(new, GatedMLP)
            assert new.gate_proj is orig.gate_proj and new.up_proj is orig.up_proj and new.down_proj is orig.down_proj
        loss = model(ids, labels=ids).loss
        loss.backward()  # gradients land on the original (shared) projections
        torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-6)
        for n, p in model.named_parameters():
            if "mlp" in n:
                torch.testing.assert_close(p.grad, expected_grads[n], rtol=1e-4, atol=1e-6)

    assert all(model.get_submodule(n) is m for n, m in originals.items())


def test_bf16_model_passes_parity_check():
    model = tiny("Llama").to(torch.bfloat16)
    report = swap(model, ["swiglu"])
    assert len(report.swapped) == 2 and report.skipped == []
    unswap(model)


class LlamaLikeButScaled(nn.Module):
    """gate_proj / up_proj / down_proj / SiLU act_fn, but the forward does something else."""

    def __init__(self):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x)) * 0.5


def test_matched_by_behaviour_not_only_structure():
    assert not SWAP.matches(LlamaLikeButScaled())
    gelu_mlp = tiny("Llama", hidden_act="gelu").model.layers[0].mlp  # a GELU-gated MLP is geglu's, not ours
    assert not SWAP.matches(gelu_mlp)
    assert SWAP.matches(tiny("Llama").model.layers[0].mlp)


# torch.compile(fullgraph=True) must not graph-break on the op, forward or backward. On a GPU: Inductor,
# which sees into the Triton kernels; on the CPU (Triton's interpreter) the op is opaque: aot_eager.
DEVICE, BACKEND = ("cuda", "inductor") if torch.cuda.is_available() else ("cpu", "aot_eager")


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_compile_fullgraph_forward_backward(op):
    gate, up = (torch.randn(64, 1000, device=DEVICE, requires_grad=True) for _ in range(2))
    fn = (lambda g, u: swiglu(g, u * 2)) if op == "swiglu" else (lambda g, u: geglu(g, u * 2, "none"))
    torch._dynamo.reset()
    out, ref = torch.compile(fn, fullgraph=True, backend=BACKEND)(gate, up), fn(gate, up)
    torch.testing.assert_close(out, ref)
    for g, r in zip(torch.autograd.grad(out.sum(), [gate, up]), torch.autograd.grad(ref.sum(), [gate, up])):
        torch.testing.assert_close(g, r)


def test_gated_mlp_backward_reuses_the_projections_outputs():
    torch.manual_seed(0)
    gate_proj, up_proj, down_proj = nn.Linear(16, 40), nn.Linear(16, 40), nn.Linear(40, 16)
    mlp = GatedMLP(gate_proj, up_proj, down_proj, act=SILU)
    x = torch.randn(3, 16, requires_grad=True)
    # The gradients written over gate_proj(x) and up_proj(x) equal the ones written to new buffers.
    fresh = torch.autograd.grad(down_proj(swiglu(gate_proj(x), up_proj(x))).sum(), [x, *mlp.parameters()])
    out = mlp(x).sum()
    reused = torch.autograd.grad(out, [x, *mlp.parameters()], retain_graph=True)
    for a, b in zip(fresh, reused):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(out, [x])  # the saved activations now hold gradients: refused, not misread


@pytest.mark.parametrize("shape", [(3, 16), (2, 5, 16)])  # 3-D: linear saves a 2-D view of its input
def test_gated_mlp_recomputes_the_activation_instead_of_keeping_it(shape):
    import gc
    import weakref
    torch.manual_seed(0)
    gate_proj, up_proj, down_proj = nn.Linear(16, 40), nn.Linear(16, 40), nn.Linear(40, 16)
    x = torch.randn(*shape, requires_grad=True)
    kept = []
    down_proj.register_forward_pre_hook(lambda _m, args: kept.append(weakref.ref(args[0])))
    grads, alive = {}, {}
    for recompute in (False, True):
        mlp = GatedMLP(gate_proj, up_proj, down_proj, act=SILU, recompute=recompute)
        out = mlp(x).sum()
        gc.collect()
        alive[recompute] = kept.pop()() is not None  # is down_proj's input still held by the graph?
        grads[recompute] = torch.autograd.grad(out, [x, *mlp.parameters()])
    assert alive == {False: True, True: False}
    for a, b in zip(grads[False], grads[True]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # the recomputed activation is bit-identical


@pytest.mark.parametrize("shape", [(3, 16), (2, 5, 16)])
def test_gated_mlp_recomputes_in_the_activation_backward_over_a_plain_linear(shape):
    """Without hooks on down_proj, recompute (by default, and with True) keeps gate and up alone
    (GatedDownFunction): the activation's backward kernel writes the activation again for down_proj's weight
    gradient. The gradients equal those of the path that keeps the activation."""
    torch.manual_seed(0)
    gate_proj, up_proj, down_proj = nn.Linear(16, 40), nn.Linear(16, 40), nn.Linear(40, 16)
    params = {p.untyped_storage().data_ptr() for p in (*gate_proj.parameters(), *up_proj.parameters(),
                                                       *down_proj.parameters())}
    x = torch.randn(*shape, requires_grad=True)
    grads, kept = {}, {}
    for recompute in (False, None, True):
        mlp = GatedMLP(gate_proj, up_proj, down_proj, act=SILU, recompute=recompute)
        saved = []

        def pack(t):
            if t.untyped_storage().data_ptr() not in params | {x.untyped_storage().data_ptr()}:
                saved.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = mlp(x)
        assert (type(y.grad_fn).__name__ == "GatedDownFunctionBackward") == (recompute is not False)
        out = y.sum()
        kept[recompute] = sum(saved)
        grads[recompute] = torch.autograd.grad(out, [x, *mlp.parameters()])
    rows = x.numel() // 16
    assert kept == {False: 3 * rows * 40, None: 2 * rows * 40, True: 2 * rows * 40}  # gate, up (and the activation)
    for recompute in (None, True):
        for a, b in zip(grads[False], grads[recompute]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a wrapped forward (how capture labels a module) is called, and the activation kept
    down_proj.forward = lambda h, forward=down_proj.forward: forward(h)
    assert type(GatedMLP(gate_proj, up_proj, down_proj, act=SILU)(x).grad_fn).__name__ != "GatedDownFunctionBackward"


def _kept_by_graph(fn, x, *ours) -> tuple[torch.Tensor, int]:
    """fn(x), and the elements its autograd graph holds for the backward besides x and the parameters of OURS."""
    skip = {t.untyped_storage().data_ptr() for m in ours for t in m.parameters()} | {x.untyped_storage().data_ptr()}
    saved = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = fn(x)
    return y, sum(saved)


@pytest.mark.parametrize("act", [SILU, GELU_TANH])
@pytest.mark.parametrize("shape", [(3, 16), (2, 5, 16)])
def test_gate_up_mlp_recomputes_in_the_activation_backward(shape, act):
    """Phi-3's fused gate_up_proj: by default the graph keeps gate_up alone, and the backward kernel writes the
    activation again for down_proj's weight gradient; recompute=False keeps the activation too. Gradients are
    bit-identical either way and match eager's act(gate) · up."""
    torch.manual_seed(0)
    gate_up_proj, down_proj = nn.Linear(16, 80), nn.Linear(40, 16)
    x = torch.randn(*shape, requires_grad=True)
    grads, kept = {}, {}
    for recompute in (False, None):
        mlp = GateUpMLP(gate_up_proj, down_proj, act=act, recompute=recompute)
        y, kept[recompute] = _kept_by_graph(mlp, x, gate_up_proj, down_proj)
        assert (type(y.grad_fn).__name__ == "GatedDownFunctionBackward") == (recompute is None)
        grads[recompute] = torch.autograd.grad(y.sum(), [x, *mlp.parameters()])
    rows = x.numel() // 16
    assert kept == {False: 3 * rows * 40, None: 2 * rows * 40}  # gate_up (and the activation)
    for a, b in zip(grads[False], grads[None]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    eager_act = F.silu if act == SILU else (lambda t: F.gelu(t, approximate="tanh"))
    gate, up = gate_up_proj(x).chunk(2, dim=-1)
    eager = torch.autograd.grad(down_proj(eager_act(gate) * up).sum(), [x, *mlp.parameters()])
    for a, b in zip(grads[None], eager):
        torch.testing.assert_close(a, b)
    y = GateUpMLP(gate_up_proj, down_proj, act=act)(x)
    y.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()  # the saved gate_up now holds its gradient: refused, not misread
    down_proj.register_forward_hook(lambda *_: None)  # a hooked down_proj (capture's labels) keeps the activation
    assert type(GateUpMLP(gate_up_proj, down_proj, act=act)(x).grad_fn).__name__ != "GatedDownFunctionBackward"


@pytest.mark.parametrize("fused_projection", [False, True])
def test_a_small_call_runs_eagers_ops_and_nothing_else(monkeypatch, fused_projection):
    """Below NATIVE_BELOW (a small 16-bit GPU call, forced here on the CPU) the host sets the time, so the
    gated MLP runs eager's own ops, forward and backward, and no others: the same ATen calls as the HF module's
    (in another order: both projections first)."""
    import sys
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    # the op file's module: `profiler_svc.kernels.swiglu` as an attribute is the function of that name
    monkeypatch.setattr(sys.modules["profiler_svc.kernels.swiglu"], "_native", lambda t: True)

    class Calls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    if fused_projection:
        gate_up_proj, down_proj = nn.Linear(16, 80), nn.Linear(40, 16)
        ours = GateUpMLP(gate_up_proj, down_proj, act=SILU)

        def eager(x):
            gate, up = gate_up_proj(x).chunk(2, dim=-1)
            return down_proj(F.silu(gate) * up)
    else:
        mlp = tiny("Llama").model.layers[0].mlp
        ours, eager = GatedMLP(mlp.gate_proj, mlp.up_proj, mlp.down_proj, act=SILU), mlp
    x = torch.randn(3, ours.down_proj.out_features, requires_grad=True)
    seen = {}
    for name, fn in (("eager", eager), ("ours", ours)):
        with Calls() as calls:
            out = fn(x)
            grads = torch.autograd.grad(out.sum(), [x, *ours.parameters()])
        seen[name] = (calls.ops, out, grads)
    assert Counter(seen["ours"][0]) == Counter(seen["eager"][0])
    torch.testing.assert_close(seen["ours"][1], seen["eager"][1], rtol=0, atol=0)
    for a, b in zip(seen["ours"][2], seen["eager"][2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("fused_projection", [False, True])
@pytest.mark.parametrize("hook", ["full_backward", "full_backward_pre"])
def test_a_backward_hook_on_down_proj_is_called(fused_projection, hook):
    """The recompute path runs down_proj by its weight, without calling the module: a down_proj with a backward
    hook (a gradient monitor's) keeps the module call, and its hook fires."""
    torch.manual_seed(0)
    down_proj, called = nn.Linear(40, 16), []
    getattr(down_proj, f"register_{hook}_hook")(lambda *_: called.append(True))
    mlp = GateUpMLP(nn.Linear(16, 80), down_proj, act=SILU) if fused_projection else \
        GatedMLP(nn.Linear(16, 40), nn.Linear(16, 40), down_proj, act=SILU)
    y = mlp(torch.randn(3, 16, requires_grad=True))
    assert type(y.grad_fn).__name__ != "GatedDownFunctionBackward"
    y.sum().backward()
    assert called


class DropoutMLP(nn.Module):
    """down(dropout(act(gate(x)) · up(x))): a gated MLP in eval mode, but the replacement has no dropout."""

    def __init__(self, dropout):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = nn.Linear(8, 16), nn.Linear(8, 16), nn.Linear(16, 8)
        self.act_fn, self.dropout = nn.SiLU(), dropout

    def forward(self, x):
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))


@pytest.mark.parametrize("dropout", [nn.Dropout(0.5), nn.AlphaDropout(0.1), nn.Dropout1d(0.2)], ids=lambda d: type(d).__name__)
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_mlps_holding_dropout_are_not_matched(dropout, mode):
    mlp = getattr(DropoutMLP(dropout), mode)()
    assert not SWAP.matches(mlp)
    assert SWAP.matches(DropoutMLP(nn.Dropout(0.0)))  # p = 0 drops nothing: the fused MLP computes the same


@pytest.mark.parametrize("scope", ["module", "global"])
@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_a_projection_output_a_hook_saw_is_not_overwritten_by_the_backward(family, scope):
    """The fused backward writes gate's and up's gradients over the projections' outputs, which are the MLP's
    alone, unless a forward hook saw them: an activation a hook records stayed a reference and turned into a
    gradient (changed by up to 1.4 on a 16-wide MLP). With a hook the outputs are left alone; gradients as eager's."""
    import copy

    from transformers import LlamaConfig, Phi3Config
    from transformers.models.llama.modeling_llama import LlamaMLP
    from transformers.models.phi3.modeling_phi3 import Phi3MLP

    torch.manual_seed(0)
    if family == "llama":
        eager = LlamaMLP(LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2))
        hooked = "gate_proj"
    else:
        eager = Phi3MLP(Phi3Config(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2))
        hooked = "gate_up_proj"
    model = nn.Sequential(copy.deepcopy(eager))
    assert [s for *_, s, _, _ in swap(model, ["swiglu"]).swapped] == ["swiglu"]
    seen = []
    projection = getattr(model[0], hooked)
    if scope == "module":
        getattr(model[0], hooked).register_forward_hook(lambda module, args, out: seen.append(out))
    else:  # every module's calls (torch.nn.modules.module.register_module_forward_hook)
        handle = nn.modules.module.register_module_forward_hook(
            lambda module, args, out: seen.append(out) if module is projection else None)
    x = torch.randn(4, 16, requires_grad=True)
    try:
        y = model(x)
    finally:
        if scope == "global":
            handle.remove()
    before = seen[0].detach().clone()
    grad = torch.randn_like(y)
    y.backward(grad)
    torch.testing.assert_close(seen[0].detach(), before, rtol=0, atol=0)
    x_eager = x.detach().clone().requires_grad_()
    eager(x_eager).backward(grad)
    torch.testing.assert_close(x.grad, x_eager.grad, rtol=1e-5, atol=1e-6)
