"""Capture the agent fixtures: real GPU workloads recorded with ``profiler_svc.capture``.

Run on a CUDA machine with transformers installed:

    python tests/data/agent/capture_agent_fixture.py OUT_DIR

Models are built from configs with random weights (nothing is downloaded). Each fixture's
factory is also its workload (``capture_agent_fixture:<name>``, importable from this folder),
which the A/B service can re-run: it returns (model, inputs) or (model, inputs, loss_fn).
OUT_DIR gets one ``<name>.json.gz`` per fixture and ``manifest.json`` saying how each was made.
"""
import json
import os
import sys
import time

import torch

LLAMA = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
             num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
GPT2 = dict(n_layer=2, n_embd=768, n_head=12)
# The savings issue's host-bound case: 8 layers, hidden 2048, training at 1x512 tokens.
LLAMA8 = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
LLAMA_BATCH, GPT2_BATCH = (4, 512), (8, 256)
DEVICE = "cuda"


def _build(model_class, config_class, config, attn, dtype, **settings):
    import transformers
    torch.manual_seed(0)
    cfg = getattr(transformers, config_class)(**config, **settings)
    cfg._attn_implementation = attn
    with torch.device(DEVICE):
        return getattr(transformers, model_class)(cfg).to(dtype)


def llama_bf16_train_agent():
    """Llama, bf16, SDPA, training: eager RMSNorm, SiLU*mul and rotary chains to attribute."""
    model = _build("LlamaForCausalLM", "LlamaConfig", LLAMA, "sdpa", torch.bfloat16)
    ids = torch.randint(0, LLAMA["vocab_size"], LLAMA_BATCH, device=DEVICE)
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss


def gpt2_fp32_notf32_infer_agent():
    """GPT-2, fp32 with TF32 off, eager attention, inference: FFMA GEMMs and eager attention."""
    model = _build("GPT2LMHeadModel", "GPT2Config", GPT2, "eager", torch.float32).eval()
    ids = torch.randint(0, 50257, GPT2_BATCH, device=DEVICE)
    return model, {"input_ids": ids}


def llama8_bf16_1x512_train_calibrated():
    """Llama 8 x 2048, bf16, SDPA, training at 1x512: host-bound, where the profiler's cost shows most."""
    model = _build("LlamaForCausalLM", "LlamaConfig", LLAMA8, "sdpa", torch.bfloat16)
    ids = torch.randint(0, LLAMA8["vocab_size"], (1, 512), device=DEVICE)
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss


def llama8_bf16_4x1024_train_calibrated():
    """The same model at 4x1024: GPU-bound."""
    model = _build("LlamaForCausalLM", "LlamaConfig", LLAMA8, "sdpa", torch.bfloat16)
    ids = torch.randint(0, LLAMA8["vocab_size"], (4, 1024), device=DEVICE)
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss


def llama_bf16_nocache_train_calibrated():
    """Llama, bf16, SDPA, training with use_cache=False (as training scripts set it): transformers then checks the
    position ids for packed sequences on the host in every forward, a sync."""
    model = _build("LlamaForCausalLM", "LlamaConfig", LLAMA, "sdpa", torch.bfloat16, use_cache=False)
    ids = torch.randint(0, LLAMA["vocab_size"], LLAMA_BATCH, device=DEVICE)
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss


def llama_bf16_fused_adamw_train():
    """Llama, bf16, SDPA, training with torch's fused AdamW (fused=True, as Hugging Face's Trainer defaults to):
    one multi-tensor kernel per chunk of the parameter lists, below the copy's rate."""
    return llama_bf16_train_agent()


def _to_module_device(module, args, kwargs):
    """A forward pre-hook: the call's tensors (and tuples of them) moved to the module's GPU, as accelerate's
    device_map hooks do (accelerate need not be installed)."""
    device = next(module.parameters()).device

    def moved(x):
        if torch.is_tensor(x):
            return x.to(device, non_blocking=True)
        return tuple(moved(y) for y in x) if isinstance(x, tuple) else x
    return tuple(moved(a) for a in args), {k: moved(v) for k, v in kwargs.items()}


def llama8_bf16_two_gpu_pipeline_train():
    """One process, two GPUs: Llama 8 x 2048 with layers 0-3 (and the embedding) on cuda:0, layers 4-7, the final
    norm and the head on cuda:1, as device_map="auto" splits a model; each GPU runs its own stream 7."""
    model = _build("LlamaForCausalLM", "LlamaConfig", LLAMA8, "sdpa", torch.bfloat16)
    second = torch.device("cuda", 1)
    for layer in model.model.layers[LLAMA8["num_hidden_layers"] // 2:]:
        layer.to(second).register_forward_pre_hook(_to_module_device, with_kwargs=True)
    for module in (model.model.norm, model.lm_head):
        module.to(second).register_forward_pre_hook(_to_module_device, with_kwargs=True)
    ids = torch.randint(0, LLAMA8["vocab_size"], (2, 1024), device=DEVICE)
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss


def llama_bf16_data_parallel_train():
    """One process, two GPUs, torch.nn.DataParallel: each replica's forward launched from a thread of its own, its
    backward from autograd's thread for that GPU."""
    model = torch.nn.DataParallel(_build("LlamaForCausalLM", "LlamaConfig", LLAMA, "sdpa", torch.bfloat16),
                                  device_ids=[0, 1])
    ids = torch.randint(0, LLAMA["vocab_size"], (8, 512), device=DEVICE)
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss.mean()


FIXTURES = {
    "llama_bf16_train_agent": dict(
        factory=llama_bf16_train_agent, model="LlamaForCausalLM", config=LLAMA, dtype="bf16", attn="sdpa",
        batch="x".join(map(str, LLAMA_BATCH)), mode="train (fwd+bwd+AdamW foreach)", numerics="defaults (TF32 matmul off)"),
    "gpt2_fp32_notf32_infer_agent": dict(
        factory=gpt2_fp32_notf32_infer_agent, model="GPT2LMHeadModel", config=GPT2, dtype="fp32", attn="eager",
        batch="x".join(map(str, GPT2_BATCH)), mode="inference (no_grad)", numerics="allow_tf32 off (matmul, cudnn), precision highest"),
    # calibrated: capture's default schedule (wait 2: the second wait step is timed unprofiled), no sync per
    # step, and the step also timed unprofiled over 20 steps before the capture, to check the calibration
    "llama8_bf16_1x512_train_calibrated": dict(
        factory=llama8_bf16_1x512_train_calibrated, model="LlamaForCausalLM", config=LLAMA8, dtype="bf16",
        attn="sdpa", batch="1x512", mode="train (fwd+bwd+AdamW foreach)", numerics="defaults", calibrated=True),
    "llama8_bf16_4x1024_train_calibrated": dict(
        factory=llama8_bf16_4x1024_train_calibrated, model="LlamaForCausalLM", config=LLAMA8, dtype="bf16",
        attn="sdpa", batch="4x1024", mode="train (fwd+bwd+AdamW foreach)", numerics="defaults", calibrated=True),
    "llama_bf16_nocache_train_calibrated": dict(
        factory=llama_bf16_nocache_train_calibrated, model="LlamaForCausalLM", config=LLAMA, dtype="bf16", attn="sdpa",
        batch="x".join(map(str, LLAMA_BATCH)), mode="train (fwd+bwd+AdamW foreach), use_cache=False",
        numerics="defaults", calibrated=True),
    "llama8_bf16_two_gpu_pipeline_train": dict(
        factory=llama8_bf16_two_gpu_pipeline_train, model="LlamaForCausalLM, layers 0-3 on cuda:0, 4-7 and the head on cuda:1",
        config=LLAMA8, dtype="bf16", attn="sdpa", batch="2x1024", mode="train (fwd+bwd+AdamW foreach)",
        numerics="defaults", calibrated=True, gpus=2),
    "llama_bf16_fused_adamw_train": dict(
        factory=llama_bf16_fused_adamw_train, model="LlamaForCausalLM", config=LLAMA, dtype="bf16", attn="sdpa",
        batch="x".join(map(str, LLAMA_BATCH)), mode="train (fwd+bwd+AdamW fused=True)", numerics="defaults",
        calibrated=True, optimizer="fused"),
    "llama_bf16_data_parallel_train": dict(
        factory=llama_bf16_data_parallel_train, model="torch.nn.DataParallel(LlamaForCausalLM), 2 GPUs", config=LLAMA,
        dtype="bf16", attn="sdpa", batch="8x512 (4x512 a GPU)", mode="train (fwd+bwd+AdamW foreach)",
        numerics="defaults", calibrated=True, gpus=2),
}


def set_numerics(name):
    """torch's defaults (TF32 off for matmul, on for cuDNN); the notf32 fixtures turn cuDNN's off too."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = "notf32" not in name
    torch.set_float32_matmul_precision("highest")


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def capture(name, out_dir):
    import profiler_svc
    info = FIXTURES[name]
    set_numerics(name)
    made = info["factory"]()
    model, inputs = made[:2]
    if len(made) == 3:
        loss_fn = made[2]
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4,
                                **({"fused": True} if info.get("optimizer") == "fused" else {"foreach": True}))

        def step():
            loss_fn(model(**inputs)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        step = torch.no_grad()(lambda: model(**inputs))
    step()  # outside the profiler: cuBLAS handles, autotuning
    sync()
    path = os.path.join(out_dir, name + ".json.gz")
    if info.get("calibrated"):
        return info_of(info) | calibrated_capture(name, model, step, path)
    with profiler_svc.capture(model, out=path, wait=1, warmup=1, active=2,
                              workload=f"capture_agent_fixture:{name}") as cap:
        for _ in range(4):
            step()
            sync()
            cap.step()
    return info_of(info) | {
        "capture": "profiler_svc.capture(model, wait=1, warmup=1, active=2); cap.step() after each step",
        "workload": f"capture_agent_fixture:{name}", "gz_bytes": os.path.getsize(cap.trace_path)}


def info_of(info):
    return {k: v for k, v in info.items() if k != "factory"}


def calibrated_capture(name, model, step, path):
    """The step timed unprofiled (20 steps, CUDA events, after 5 warm-up ones), then captured with capture's
    default schedule and no sync per step, as a training loop runs."""
    import statistics
    import profiler_svc
    for _ in range(5):
        step()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(21)]
    events[0].record()
    for i in range(20):
        step()
        events[i + 1].record()
    sync()
    reference = statistics.median(a.elapsed_time(b) * 1e3 for a, b in zip(events, events[1:]))
    with profiler_svc.capture(model, out=path, active=2, workload=f"capture_agent_fixture:{name}") as cap:
        steps = cap.schedule["wait"] + cap.schedule["warmup"] + cap.schedule["active"]
        for _ in range(steps):
            step()
            cap.step()
    return {"capture": f"profiler_svc.capture(model, active=2) (wait {cap.schedule['wait']}, warmup "
                       f"{cap.schedule['warmup']} by default); cap.step() after each of {steps} steps, no synchronize",
            "workload": f"capture_agent_fixture:{name}", "gz_bytes": os.path.getsize(cap.trace_path),
            "reference_unprofiled_step_us": round(reference, 2)}


def main(out_dir, names=None):
    import transformers
    os.makedirs(out_dir, exist_ok=True)
    manifest = {"environment": {"torch": torch.__version__, "transformers": transformers.__version__,
                                "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
                                "captured": time.strftime("%Y-%m-%d")},
                "fixtures": {}}
    for name in names or [n for n, info in FIXTURES.items() if not info.get("calibrated")]:
        manifest["fixtures"][name] = capture(name, out_dir)
        print("ok", name, manifest["fixtures"][name]["gz_bytes"], flush=True)
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
