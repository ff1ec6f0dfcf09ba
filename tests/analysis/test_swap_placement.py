"""A recommendation names a bundled swap only where it applies to the model in the trace: the capture's
module tree against the placement rules (kernels/placement.py). Real traces from tests/data/agent; the
tree edited where a test needs a model the fixtures do not have, the kernels and labels left as captured."""
import gzip
import json
import os

import pytest

from profiler_svc.recommendations import recommend
from tests.plugins.traces import fixture_path

LLAMA = "llama_bf16_train_agent"
# Phi-3 (fused gate_up_proj), bf16 training at 4x2048 on an H100: predict_vs_ab's trace of 2026-11-27
# (benchmarks/results/predict_vs_ab.md says how it was made)
PHI3_TRAIN = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "results",
                          "pva_traces_h100_2026-11-27_gpu_bound", "phi3_4x2048_train.json.gz")


def unfused(report):
    return {f.evidence["pattern"]: f for f in report.findings if f.category == "unfused_chain"}


def with_tree(tmp_path, name, edit):
    """The fixture (or the trace at a path) with its capture metadata's module tree passed through `edit`, as a new
    trace file."""
    data = json.loads(gzip.open(name if os.path.isfile(name) else fixture_path(name)).read())
    edit(data["profiler_svc"]["modules"])
    path = tmp_path / f"{os.path.basename(name).removesuffix('.json.gz')}_edited.json.gz"  # a path's name, not the path
    path.write_bytes(gzip.compress(json.dumps(data).encode()))
    return path


def test_llama_names_the_swaps_that_apply_and_a_code_fix_for_its_functional_loss():
    report = recommend(fixture_path(LLAMA))
    chains = unfused(report)
    for pattern, count in (("rms_norm", 5), ("swiglu", 2), ("rope", 2)):
        finding = chains[pattern]
        assert finding.recommendation.swap == pattern  # it applies: Report.predict can price it
        assert finding.evidence["swap_applies_to"] == count and finding.evidence["swap_does_not_apply_to"] == []
        if finding.saving_us_per_step > 0:
            assert f"for {count} module instances" in finding.recommendation.summary
        else:  # predicted to slow the step: applies, but not recommended
            assert finding.recommendation.summary.startswith("Keep the eager code")
            assert "torch.compile" in finding.recommendation.snippet and "swap(" not in finding.recommendation.snippet
    # On this host-bound step the swiglu swap's host time outweighs its fused kernel: its calls (4x512x2816, above
    # NATIVE_BELOW) take the Triton path, which costs the host more than eager's MLP (kernels/host_costs.json, ours -
    # eager at 4096 rows); rope's and rms_norm's calls cost less host time than the eager code they replace.
    assert chains["swiglu"].saving_us_per_step < 0 < min(chains["rope"].saving_us_per_step,
                                                         chains["rms_norm"].saving_us_per_step)
    assert "swiglu" not in report.swaps() and {"rope", "rms_norm"} <= set(report.swaps())
    # HF computes the loss with a function call in LlamaForCausalLM.forward: no nn.CrossEntropyLoss to swap
    loss = chains["cross_entropy"]
    assert loss.recommendation.swap is None
    assert "fused linear cross-entropy" in loss.recommendation.summary
    assert "fused_linear_cross_entropy(hidden, lm_head.weight, labels)" in loss.recommendation.snippet
    assert "No bundled swap applies: the `cross_entropy` swap replaces nn.CrossEntropyLoss modules" in loss.detail
    assert "LlamaForCausalLM's forward" in loss.detail


def test_gpt2_gelu_modules_take_the_gelu_swap():
    chains = unfused(recommend(fixture_path("gpt2_fp32_notf32_infer_agent")))
    assert chains["gelu_tanh"].recommendation.swap == "gelu_tanh"
    assert chains["gelu_tanh"].evidence["swap_applies_to"] == 2


def test_an_mlp_whose_activation_is_not_silu_gets_a_code_fix_not_the_swap(tmp_path):
    # the same kernels, but the tree says the MLPs' activation is some other module: swiglu does not apply
    def edit(tree):
        for name, node in tree.items():
            if name.endswith("mlp.act_fn"):
                node["class"] = "ScaledTanh"

    chains = unfused(recommend(with_tree(tmp_path, LLAMA, edit)))
    mlp = chains["swiglu"]
    assert mlp.recommendation.swap is None and "swiglu(gate, up)" in mlp.recommendation.snippet
    assert "No bundled swap applies" in mlp.detail and mlp.evidence["swap_applies_to"] == 0
    assert chains["rms_norm"].recommendation.swap == "rms_norm"  # the rest of the model is unchanged


def test_phi3_like_fused_gate_up_projection_still_takes_swiglu(tmp_path):
    def edit(tree):
        for name in [n for n in tree if n.endswith(("mlp.gate_proj", "mlp.up_proj"))]:
            node = tree.pop(name)
        for name in [n for n in tree if n.endswith(".mlp")]:
            tree[f"{name}.gate_up_proj"] = {"class": "Linear", "params": node["params"]}

    assert unfused(recommend(with_tree(tmp_path, LLAMA, edit)))["swiglu"].recommendation.swap == "swiglu"


def test_without_rotary_module_the_attention_chain_gets_the_rope_call_not_the_swap(tmp_path):
    chains = unfused(recommend(with_tree(tmp_path, LLAMA, lambda tree: tree.pop("model.rotary_emb"))))
    rope = chains["rope"]
    assert rope.recommendation.swap is None and "rope(q, k, cos, sin)" in rope.recommendation.snippet


@pytest.mark.parametrize("name", ["llama_bf16_train"])
def test_a_trace_without_module_tree_keeps_naming_the_swap(name):
    # a plain torch.profiler trace: applicability cannot be told, so the swap is still named
    chains = unfused(recommend(fixture_path(name)))
    assert chains["rms_norm"].recommendation.swap == "rms_norm"
    assert "swap_applies_to" not in chains["rms_norm"].evidence


@pytest.mark.parametrize("junk", ["junk", 5, None, ["x"], {"class": 7, "params": {"gate_up_proj": {"shape": "abc"}}}])
def test_a_module_tree_with_junk_nodes_is_read_around_them(tmp_path, junk):
    """The tree comes from the trace file: nodes that are not module records are skipped, never a traceback.
    The experts blocks (intact, with their activation child) still take the swap that routes their tokens."""
    def spoil(tree):
        for name in list(tree):
            if name.endswith(("mlp.gate", "self_attn.q_proj", "input_layernorm")):
                tree[name] = junk
    report = recommend(with_tree(tmp_path, "mixtral_bf16_1x256_infer", spoil))
    assert report.findings and "swiglu" in report.swaps()


def test_a_gated_backward_is_priced_by_whether_the_swap_writes_the_activation_again(tmp_path):
    """The gated swap's backward kernel reads the activation's gradient, gate and up and writes their gradients: 5
    activation-sized passes where the module keeps its activation (Phi-3's one gate_up_proj), 6 where it writes
    the activation again for down_proj's weight gradient (separate gate and up projections)."""
    activation = 4 * 2048 * 5632 * 2  # the recorded [4, 2048, 5632] bf16 activation of each chain

    def backward_passes(path):
        backward = unfused(recommend(path))["swiglu"].evidence["directions"]["backward"]
        return backward["fused_min_bytes"] / backward["chains"] / activation

    def separate_projections(tree):
        for name in [n for n in tree if n.endswith("mlp.gate_up_proj")]:
            node = tree.pop(name)
            half = {"weight": {"dtype": "bfloat16", "shape": [5632, 2048]}}
            tree[name.replace("gate_up_proj", "gate_proj")] = {"class": node["class"], "params": half}
            tree[name.replace("gate_up_proj", "up_proj")] = {"class": node["class"], "params": half}

    assert backward_passes(PHI3_TRAIN) == 5
    assert backward_passes(with_tree(tmp_path, PHI3_TRAIN, separate_projections)) == 6
