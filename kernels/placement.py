"""Where each bundled swap can go, judged from a module tree alone (no model, no torch).

The tree is the capture metadata's `modules`: {qualified name: {"class": str, "params": {name: {"dtype",
"shape"}}}}, the root "". A live swap decides by running the module (`SwapEntry.matches`); a trace
only has class names and parameter shapes, so these rules are that decision's structural part: a swap
*applies* to a module when the module has the structure its swap entry matches, and a recommendation
names the swap only then. tests/kernels/test_coverage.py checks that the rules and the live registry
agree on every family it builds.

Standard library only, and no relative imports: the analyser (profiler_svc.detectors.swap_costs) loads
this file by its path, without importing the kernels package (which imports torch and Triton).
"""
import re

_SILU = re.compile(r"(SiLU|Swish)", re.I)
_GELU = re.compile(r"GELU", re.I)
_ACTIVATION_CHILDREN = ("act_fn", "activation_fn")
_LINEAR = re.compile(r"Linear")  # nn.Linear and its quantized / LoRA look-alikes
# the order swap.py tries its swaps on a module (its _OP_FILES): whole blocks before their children's swaps
REGISTRY_ORDER = ("residual_rms_norm", "rms_norm", "layer_norm", "swiglu", "geglu", "gelu_tanh", "softmax", "cross_entropy",
                  "rope")
# the swaps whose replacement keeps the module's children in place, where the other swaps still act on them
_KEEPS_CHILDREN = ("residual_rms_norm", "rope")

# swap (or variant) -> elements below which its host function hands a 16-bit GPU call to torch's native ops
# (the op file reads its threshold here; the analyser prices a call by the path it takes). The gated MLPs'
# native path is eager's own act(gate) * up, so there a swapped call changes nothing (NATIVE_IS_EAGER);
# RMSNorm's is the fused F.rms_norm, and Gemma's (1 + w) norm's ("rms_norm_offset") the same in fp32, which
# moves 16 bytes more per element than our kernel. At 2^22 elements eager's gated pair moves 16 MB more than
# the fused kernel (about 5 µs on an H100) and saves some 100 µs of host time per call; the thresholds are
# the crossover sweeps' (benchmarks/results/host_costs_h100.md).
# LayerNorm, softmax, cross-entropy and tanh-GELU hand such calls to F.layer_norm, torch.softmax,
# F.cross_entropy (on fp32 logits, as HF's loss) and F.gelu: one ATen kernel each way, which the sweeps found no
# slower than our Triton path up to 2^23-2^25 elements, at a fifth to a third of its host time per call.
NATIVE_BELOW = {"rms_norm": 1 << 22, "rms_norm_offset": 1 << 22, "swiglu": 1 << 22, "geglu": 1 << 22,
                "layer_norm": 1 << 22, "softmax": 1 << 22, "cross_entropy": 1 << 22, "gelu_tanh": 1 << 22}
NATIVE_IS_EAGER = frozenset({"swiglu", "geglu"})
# In training, a norm output of ours of at least this many elements (no fused residual) is not kept by the
# projections that read it inside our stand-ins (rope's attention, the gated MLPs): they keep a recipe and run the
# norm's forward kernel again in the backward (kernels/_norm.py, saved_as_recipe). Below it a step is short enough
# that the recompute's launch would cost more host time than the memory is worth.
RECOMPUTE_NORM_OUTPUT_MIN = 1 << 22

# swap -> class-name pattern of the module it replaces, for the swaps matched on one leaf module
_LEAF_CLASSES = {
    "rms_norm": re.compile(r"(RMSNorm|T5LayerNorm)$"),
    "layer_norm": re.compile(r"(?<!RMS)(?<!T5)LayerNorm$"),
    "gelu_tanh": re.compile(r"^(NewGELUActivation|GELUTanh|PytorchGELUTanh|GELU)$"),
    "softmax": re.compile(r"^Softmax$"),
    "cross_entropy": re.compile(r"^CrossEntropyLoss$"),
}


def _children(tree: dict, name: str) -> dict:
    """{child attribute name: node} of the module `name`."""
    prefix = f"{name}." if name else ""
    return {key[len(prefix):]: node for key, node in tree.items()
            if isinstance(node, dict) and key.startswith(prefix) and key != name and "." not in key[len(prefix):]}


def _params(node: dict) -> dict:
    params = node.get("params")
    return params if isinstance(params, dict) else {}


def _ndim(param) -> int:
    shape = param.get("shape") if isinstance(param, dict) else None
    return len(shape) if isinstance(shape, list) else -1


def _node_params(tree: dict, name: str) -> dict:
    node = tree.get(name)
    return _params(node) if isinstance(node, dict) else {}


def is_experts_block(tree: dict, name: str) -> bool:
    """An MoE experts block (3-D gate_up_proj/down_proj parameters): the gated swaps route its tokens too."""
    params = _node_params(tree, name)
    return _ndim(params.get("gate_up_proj")) == 3 and _ndim(params.get("down_proj")) == 3


def experts_hidden_size(tree: dict, name: str):
    """H of an experts block's down_proj [E, H, I], or None where the tree does not record a usable one."""
    if not is_experts_block(tree, name):
        return None
    hidden = _node_params(tree, name)["down_proj"]["shape"][1]
    return hidden if isinstance(hidden, int) and hidden > 0 else None


def gated_backward_passes(tree, name: str) -> int:
    """Activation-sized tensor passes of a gated swap's backward kernel: it reads the activation's gradient, gate
    and up and writes their gradients (5). Where the module keeps no activation for down_proj's weight gradient
    (separate gate/up projections, GatedMLP; MoE experts) it also writes the activation again (6); one fused
    gate_up_proj Linear (Phi-3's GateUpMLP) keeps it. Without a module tree: the commoner separate projections."""
    children = _children(tree, name) if isinstance(tree, dict) and name in tree else {}
    fused = "gate_up_proj" in children and _LINEAR.search(str(children["gate_up_proj"].get("class", "")))
    return 5 if fused else 6


def norm_output_recomputed(tree, name: str, elements: int) -> bool:
    """Is the norm swap's output at module `name` computed again in the backward: ELEMENTS (its output's) at least
    RECOMPUTE_NORM_OUTPUT_MIN, and a sibling that the rope or a gated swap replaces (the pre-norm layer's attention
    or MLP, whose projections read it)? Without a module tree: no."""
    if elements < RECOMPUTE_NORM_OUTPUT_MIN or not isinstance(tree, dict) or name not in tree or "." not in name:
        return False
    parent = name.rsplit(".", 1)[0]
    return any(swap in ("rope", "swiglu", "geglu") for sibling in _children(tree, parent)
               if f"{parent}.{sibling}" != name for swap in swaps_for_module(tree, f"{parent}.{sibling}"))


def _gated_activation(tree: dict, name: str, node: dict):
    """'silu' or 'gelu' if `name` is a gated MLP (gate/up/down projections, or one gate_up_proj, Phi-3) or an
    MoE experts block (3-D gate_up_proj/down_proj parameters), by its activation child's class; else None."""
    children = _children(tree, name)
    linear = lambda key: key in children and _LINEAR.search(str(children[key].get("class", "")))  # noqa: E731
    dense = all(linear(key) for key in ("gate_proj", "up_proj", "down_proj")) or (linear("gate_up_proj") and linear("down_proj"))
    if not (dense or is_experts_block(tree, name)):
        return None
    for key in _ACTIVATION_CHILDREN:
        activation = str(children.get(key, {}).get("class", ""))
        if _SILU.search(activation):
            return "silu"
        if _GELU.search(activation):
            return "gelu"
    return None


def _plain_norm(tree: dict, name: str, node: dict) -> bool:
    """A norm module as the norm swaps replace it: no children, at most a 1-D weight and bias."""
    params = _params(node)
    return not (set(params) - {"weight", "bias"} or any(_ndim(p) != 1 for p in params.values()) or _children(tree, name))


def swaps_for_module(tree: dict, name: str) -> list[str]:
    """The bundled swaps whose placement rule the module `name` of `tree` meets (usually one, or none)."""
    node = tree.get(name)
    if not isinstance(node, dict):
        return []
    cls = str(node.get("class", ""))
    found = [swap for swap, pattern in _LEAF_CLASSES.items() if pattern.search(cls)]
    if ("rms_norm" in found or "layer_norm" in found) and not _plain_norm(tree, name, node):
        found = [swap for swap in found if swap not in ("rms_norm", "layer_norm")]
    activation = _gated_activation(tree, name, node)
    if activation:
        found.append("swiglu" if activation == "silu" else "geglu")
    # residual_rms_norm: a pre-norm decoder layer (an RMSNorm before its attention, another after: the forward's
    # residual add before that one, which the live swap finds in its code, is not in a tree)
    children = _children(tree, name)
    prefix = f"{name}." if name else ""
    norms = {key for key, child in children.items()
             if _LEAF_CLASSES["rms_norm"].search(str(child.get("class", ""))) and _plain_norm(tree, prefix + key, child)}
    if "input_layernorm" in norms and len(norms) >= 2 \
            and any(str(child.get("class", "")).endswith("Attention") for child in children.values()):
        found.append("residual_rms_norm")
    # rope: an attention holding its projections, in a model with a rotary-embedding module (the forward's
    # call of apply_rotary_pos_emb, which the live swap checks, is not in a tree)
    if cls.endswith("Attention") and any(_LINEAR.search(str(child.get("class", "")))
                                         for child in _children(tree, name).values()):
        if any(str(other.get("class", "")).endswith("RotaryEmbedding") for other in tree.values() if isinstance(other, dict)):
            found.append("rope")
    return found


def swaps_for_modules(tree: dict) -> dict[str, list[str]]:
    """{qualified name: [swap]} as `swap(model)` places them: the first swap in the registry's order that
    applies to each module, and nothing inside a module replaced whole (the _KEEPS_CHILDREN swaps keep its
    children in place)."""
    placed: dict[str, list[str]] = {}
    replaced: list[str] = []
    for name in tree:
        if not name or any(name.startswith(prefix + ".") for prefix in replaced):
            continue
        swaps = sorted(swaps_for_module(tree, name), key=REGISTRY_ORDER.index)
        if swaps:
            placed[name] = swaps[:1]
            if swaps[0] not in _KEEPS_CHILDREN:
                replaced.append(name)
    return placed


def swap_applies(tree: dict, swap: str, name: str) -> bool:
    """Does `swap` apply to the module `name`, or to one of its ancestors (a chain that runs in an MLP's
    activation child belongs to the MLP the swap replaces)?"""
    while True:
        if swap in swaps_for_module(tree, name):
            return True
        if not name:
            return False
        name = name.rpartition(".")[0]
