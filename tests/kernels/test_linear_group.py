"""Linears sharing an input as one autograd node (kernels/_linear_group.py): the gradients of separate linears,
without autograd's add kernels; and the q/k/v projection group the `rope` swap installs."""
import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from profiler_svc.kernels import swap
from profiler_svc.kernels._linear_group import ProjectionGroup, linear_group

transformers = pytest.importorskip("transformers")


def _adds_in_backward(loss) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        loss.backward()
    return sum(1 for e in prof.events() if e.name in ("aten::add", "aten::add_"))


@pytest.mark.parametrize("bias", [False, True])
def test_a_group_gives_separate_linears_gradients_without_an_add_kernel(bias):
    torch.manual_seed(0)
    layers = [nn.Linear(16, width, bias=bias).double() for width in (24, 8, 8)]
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(2, 5, layer.out_features, dtype=torch.float64) for layer in layers]

    def loss(outputs):
        return sum((o * w).sum() for o, w in zip(outputs, weights))

    params = [x, *(p for layer in layers for p in layer.parameters())]
    eager = loss([layer(x) for layer in layers])
    expected = torch.autograd.grad(eager, params, retain_graph=True)
    grouped = loss(linear_group(x, layers))
    assert type(grouped.grad_fn.next_functions[0][0]).__name__ != "LinearGroupFunctionBackward"  # a sum of outputs
    got = torch.autograd.grad(grouped, params, retain_graph=True)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    assert _adds_in_backward(eager) == 2  # autograd sums x's three gradients
    for p in params:
        p.grad = None  # or the next backward adds to them
    assert _adds_in_backward(grouped) == 0


def test_a_group_runs_the_linears_as_they_are_where_no_gradient_is_needed_or_one_has_a_hook():
    layers = [nn.Linear(16, 8) for _ in range(2)]
    x = torch.randn(3, 16)
    with torch.no_grad():
        assert all(o.grad_fn is None for o in linear_group(x, layers))
    calls = []
    layers[1].register_forward_hook(lambda *_: calls.append(1))
    outputs = linear_group(x.requires_grad_(), layers)
    assert calls == [1] and all(type(o.grad_fn).__name__ == "AddmmBackward0" for o in outputs)


def test_a_projection_group_serves_the_same_input_and_computes_anything_else_alone():
    torch.manual_seed(0)
    layers = [nn.Linear(16, 8) for _ in range(3)]
    group = ProjectionGroup(layers)
    q, k, v = (group.member(i) for i in range(3))
    x = torch.randn(3, 16, requires_grad=True)
    outputs = q(x), k(x), v(x)
    assert len({type(o.grad_fn).__name__ for o in outputs}) == 1  # one node made all three
    assert "LinearGroup" in type(outputs[0].grad_fn).__name__
    for o, layer in zip(outputs, layers):
        torch.testing.assert_close(o, layer(x))
    group.finish()
    assert group.enabled
    # k and v read another tensor (cross-attention): each gets its own linear's output, and grouping stops
    memory = torch.randn(4, 16)
    got = q(x), k(memory), v(memory)
    for o, layer, source in zip(got, layers, (x, memory, memory)):
        torch.testing.assert_close(o, layer(source))
    group.finish()
    assert not group.enabled
    assert "LinearGroup" not in type(q(x).grad_fn).__name__


def test_a_projection_group_recomputes_an_input_changed_in_place_after_the_first_call():
    layers = [nn.Linear(16, 8) for _ in range(2)]
    group = ProjectionGroup(layers)
    x = torch.randn(3, 16) * torch.ones(1, requires_grad=True)
    group(0, x)
    with torch.no_grad():
        x.add_(1.0)
    torch.testing.assert_close(group(1, x), layers[1](x))


def test_the_rope_swap_groups_llamas_qkv_and_keeps_its_module_tree():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=128, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config)
    keys = list(model.state_dict())
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    model(input_ids=ids, labels=ids).loss.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    swap(model, ["rope"])
    attention = model.model.layers[0].self_attn
    assert list(model.state_dict()) == keys
    assert type(attention.q_proj).__name__ == "GroupedLinear" and attention.q_proj.weight is attention._modules["q_proj"].weight
    groups = [layer.self_attn._projections for layer in model.model.layers]
    for group in groups:
        group.enabled = False
    ungrouped_adds = _adds_in_backward(model(input_ids=ids, labels=ids).loss)
    model.zero_grad(set_to_none=True)
    for group in groups:
        group.enabled = True
    loss = model(input_ids=ids, labels=ids).loss
    assert sum("LinearGroup" in type(fn).__name__ for fn in _graph_nodes(loss)) == 2  # one a layer
    assert ungrouped_adds - _adds_in_backward(loss) == 2 * 2  # the two sums of each layer's q/k/v gradients
    for name, grad in expected.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=1e-5, atol=1e-6)
    assert attention._projections.enabled


def _graph_nodes(tensor):
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return seen


def test_the_gated_mlp_sums_its_inputs_gradient_in_its_gemms():
    from profiler_svc.kernels._elementwise import SILU
    from profiler_svc.kernels.swiglu import GatedMLP

    torch.manual_seed(0)
    gate_proj, up_proj, down_proj = nn.Linear(16, 40), nn.Linear(16, 40), nn.Linear(40, 16)
    x = torch.randn(2, 3, 16, requires_grad=True)
    eager = down_proj(nn.functional.silu(gate_proj(x)) * up_proj(x)).sum()
    assert _adds_in_backward(eager) == 1
    expected = [p.grad for p in (x, *gate_proj.parameters(), *up_proj.parameters(), *down_proj.parameters())]
    for p in (x, *gate_proj.parameters(), *up_proj.parameters(), *down_proj.parameters()):
        p.grad = None
    assert _adds_in_backward(GatedMLP(gate_proj, up_proj, down_proj, act=SILU)(x).sum()) == 0
    got = [p.grad for p in (x, *gate_proj.parameters(), *up_proj.parameters(), *down_proj.parameters())]
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)
