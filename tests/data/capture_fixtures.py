"""Capture the real-GPU trace fixtures under tests/data/.

Run on a CUDA machine with transformers, timm and torchvision installed:

    python tests/data/capture_fixtures.py OUT_DIR [NAME ...]

Every model is built from a config with random weights (nothing is downloaded).
Each fixture is a plain ``torch.profiler`` run (CPU + CUDA activities,
``record_shapes=True``, schedule wait=1 warmup=1 active=2), exported as a Chrome
trace and gzipped; ``manifest.json`` records how each was made.
"""
import contextlib
import gzip
import json
import os
import shutil
import sys
import time
import traceback

import torch
import torch.nn.functional as F

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIXTURES = {}


def fixture(name, **info):
    def register(fn):
        FIXTURES[name] = (fn, info)
        return fn
    return register


def hf(model_cls_name, config_cls_name, attn="sdpa", dtype=torch.float32, **cfg):
    import transformers
    config = getattr(transformers, config_cls_name)(**cfg)
    model_cls = getattr(transformers, model_cls_name)
    try:
        model = model_cls._from_config(config, attn_implementation=attn)
    except TypeError:
        config._attn_implementation = attn
        model = model_cls(config)
    return model.to(DEVICE, dtype)


def train_step(model, batch, opt, loss_from_out=lambda o: o.loss):
    out = model(**batch)
    loss = loss_from_out(out)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def llama_cfg(**over):
    cfg = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
               num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
    cfg.update(over)
    return cfg


# ---- fixtures ---------------------------------------------------------------------------

@fixture("llama_bf16_train", model="LlamaForCausalLM", dtype="bf16", mode="train (fwd+bwd+AdamW)",
         batch="4x512", attn="sdpa",
         plants="eager RMSNorm, SiLU*mul, rotary chains; fp32 upcast cross-entropy")
def llama_bf16_train():
    model = hf("LlamaForCausalLM", "LlamaConfig", dtype=torch.bfloat16, **llama_cfg())
    ids = torch.randint(0, 32000, (4, 512), device=DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return lambda: train_step(model, {"input_ids": ids, "labels": ids}, opt)


@fixture("llama_bf16_compiled_infer", model="LlamaForCausalLM (torch.compile)", dtype="bf16",
         mode="inference", batch="4x512", attn="sdpa",
         plants="nothing: the clean case (aligned, flash SDPA, fused by inductor)")
def llama_bf16_compiled_infer():
    model = hf("LlamaForCausalLM", "LlamaConfig", dtype=torch.bfloat16, **llama_cfg()).eval()
    ids = torch.randint(0, 32000, (4, 512), device=DEVICE)
    compiled = torch.compile(model)

    @torch.no_grad()
    def step():
        compiled(input_ids=ids).logits
    for _ in range(3):
        step()
    return step


@fixture("qwen2_bf16_decode", model="Qwen2ForCausalLM", dtype="bf16", mode="greedy decode, 24 tokens per step, KV cache",
         batch="1 (prompt 32)", attn="sdpa",
         plants="launch-bound small kernels, launch gaps, .item() host sync per token")
def qwen2_bf16_decode():
    model = hf("Qwen2ForCausalLM", "Qwen2Config", dtype=torch.bfloat16,
               vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=4,
               num_attention_heads=14, num_key_value_heads=2).eval()
    prompt = torch.randint(0, 151936, (1, 32), device=DEVICE)

    @torch.no_grad()
    def step():
        out = model(input_ids=prompt, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(24):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
            if tok.item() == -1:  # an EOS check, as user decode loops do: a host sync per token
                break
    return step


@fixture("gpt2_fp32_notf32_infer", model="GPT2LMHeadModel", dtype="fp32, TF32 off", mode="inference",
         batch="8x256", attn="eager",
         plants="fp32 GEMMs on the FFMA path (TF32 off), eager attention, Python tanh-GELU chain, vocab 50257")
def gpt2_fp32_notf32_infer():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    model = hf("GPT2LMHeadModel", "GPT2Config", attn="eager", n_layer=2, n_embd=768, n_head=12).eval()
    ids = torch.randint(0, 50257, (8, 256), device=DEVICE)
    return torch.no_grad()(lambda: model(input_ids=ids).logits)


@fixture("gpt2_fp16_train", model="GPT2LMHeadModel", dtype="fp16", mode="train (fwd+bwd+AdamW)",
         batch="4x512", attn="sdpa", plants="vocab 50257 not a multiple of 64 (lm_head GEMM N), tanh-GELU chain")
def gpt2_fp16_train():
    model = hf("GPT2LMHeadModel", "GPT2Config", dtype=torch.float16, n_layer=2, n_embd=768, n_head=12)
    ids = torch.randint(0, 50257, (4, 512), device=DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, eps=1e-4, foreach=True)
    return lambda: train_step(model, {"input_ids": ids, "labels": ids}, opt)


@fixture("bert_fp16_odd_hidden_infer", model="BertForMaskedLM", dtype="fp16", mode="inference",
         batch="16x128", attn="eager",
         plants="hidden 780 / 12 heads: head_dim 65 and GEMM K=780, 3120 not multiples of 8; vocab 30522; eager attention")
def bert_fp16_odd_hidden_infer():
    model = hf("BertForMaskedLM", "BertConfig", attn="eager", dtype=torch.float16,
               hidden_size=780, num_attention_heads=12, intermediate_size=3120, num_hidden_layers=2).eval()
    ids = torch.randint(0, 30522, (16, 128), device=DEVICE)
    return torch.no_grad()(lambda: model(input_ids=ids).logits)


@fixture("mistral_bf16_sdpa_math_infer", model="MistralForCausalLM", dtype="bf16", mode="inference",
         batch="2x1024", attn="sdpa with flash and mem-efficient backends disabled",
         plants="SDPA on the math path (materialized attention matrix)")
def mistral_bf16_sdpa_math_infer():
    torch.backends.cuda.enable_flash_sdp(False)
    torch.backends.cuda.enable_mem_efficient_sdp(False)
    torch.backends.cuda.enable_cudnn_sdp(False)
    model = hf("MistralForCausalLM", "MistralConfig", dtype=torch.bfloat16,
               **llama_cfg(sliding_window=None)).eval()
    ids = torch.randint(0, 32000, (2, 1024), device=DEVICE)
    return torch.no_grad()(lambda: model(input_ids=ids).logits)


@fixture("t5_bf16_train", model="T5ForConditionalGeneration", dtype="bf16", mode="train (fwd+bwd+AdamW)",
         batch="8x256 enc / 8x64 dec", attn="eager (T5 has only eager)",
         plants="T5LayerNorm eager RMS chain, eager attention with position bias, vocab 32128")
def t5_bf16_train():
    model = hf("T5ForConditionalGeneration", "T5Config", attn="eager", dtype=torch.bfloat16,
               d_model=512, d_ff=2048, num_layers=2, num_decoder_layers=2, num_heads=8, d_kv=64,
               vocab_size=32128, decoder_start_token_id=0)
    ids = torch.randint(0, 32128, (8, 256), device=DEVICE)
    labels = torch.randint(0, 32128, (8, 64), device=DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return lambda: train_step(model, {"input_ids": ids, "labels": labels}, opt)


@fixture("whisper_autocast_fp16_infer", model="WhisperForConditionalGeneration", dtype="fp32 weights, autocast fp16",
         mode="inference", batch="4 x 80x3000 mel / 4x64 tokens", attn="sdpa",
         plants="autocast cast storm (weights re-cast every forward), conv1d front-end")
def whisper_autocast_fp16_infer():
    model = hf("WhisperForConditionalGeneration", "WhisperConfig",
               d_model=512, encoder_layers=2, decoder_layers=2, encoder_attention_heads=8,
               decoder_attention_heads=8, encoder_ffn_dim=2048, decoder_ffn_dim=2048).eval()
    feats = torch.randn(4, 80, 3000, device=DEVICE)
    dec = torch.randint(0, 51865, (4, 64), device=DEVICE)

    @torch.no_grad()
    def step():
        with torch.autocast("cuda", dtype=torch.float16):
            model(input_features=feats, decoder_input_ids=dec).logits
    return step


@fixture("vit_autocast_bf16_train", model="timm vit_base_patch16_224", dtype="fp32 weights, autocast bf16",
         mode="train (fwd+bwd+SGD)", batch="32x3x224x224", attn="timm fused_attn (SDPA)",
         plants="autocast casts of every weight each step; native LayerNorm/GELU")
def vit_autocast_bf16_train():
    import timm
    model = timm.create_model("vit_base_patch16_224", pretrained=False, num_classes=1000).to(DEVICE)
    x = torch.randn(32, 3, 224, 224, device=DEVICE)
    y = torch.randint(0, 1000, (32,), device=DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


@fixture("resnet50_fp32_notf32_infer", model="timm resnet50", dtype="fp32, TF32 off", mode="inference",
         batch="32x3x224x224", attn="-", plants="convolutions on the FFMA/SIMT path (TF32 off)")
def resnet50_fp32_notf32_infer():
    import timm
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = timm.create_model("resnet50", pretrained=False).to(DEVICE).eval()
    x = torch.randn(32, 3, 224, 224, device=DEVICE)
    return torch.no_grad()(lambda: model(x))


@fixture("resnet18_bf16_channels_last_train", model="torchvision resnet18", dtype="bf16, channels_last",
         mode="train (fwd+bwd+SGD)", batch="64x3x224x224", attn="-",
         plants="nothing planted in the convs (aligned bf16 NHWC); the stem conv has 3 input channels")
def resnet18_bf16_channels_last_train():
    import torchvision
    model = torchvision.models.resnet18(weights=None).to(DEVICE, torch.bfloat16).to(memory_format=torch.channels_last)
    x = torch.randn(64, 3, 224, 224, device=DEVICE, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (64,), device=DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def step():
        F.cross_entropy(model(x).float(), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


@fixture("cpu_transformer_encoder_infer", model="torch.nn.TransformerEncoder (2 layers, d_model 256, 4 heads)",
         dtype="fp32", mode="inference on the CPU (no CUDA activity)", batch="8x128", attn="nn.MultiheadAttention",
         plants="nothing: a CPU-only trace has no kernels; the analyser must cope", cpu=True)
def cpu_transformer_encoder_infer():
    layer = torch.nn.TransformerEncoderLayer(d_model=256, nhead=4, dim_feedforward=1024, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, num_layers=2).eval()
    x = torch.randn(8, 128, 256)
    return torch.no_grad()(lambda: model(x))


@fixture("cpu_compiled_mlp_infer", model="torch.compile(nn.Sequential(Linear 64->128, GELU, Linear 128->64))",
         dtype="fp32", mode="inference on the CPU (no CUDA activity)", batch="8x64", attn="-",
         plants="a compiled region: its ops sit under the region's '## Call CompiledFxGraph' range", cpu=True)
def cpu_compiled_mlp_infer():
    model = torch.compile(torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 64)))
    x = torch.randn(8, 64)
    return torch.no_grad()(lambda: model(x))


# ---- second set: captured after the detectors were written, to check them on unseen models ----

@fixture("gemma_bf16_train", model="GemmaForCausalLM", dtype="bf16", mode="train (fwd+bwd+AdamW)", batch="4x512",
         attn="sdpa", plants="Gemma RMSNorm (1+w) and tanh-GELU-gated MLP as eager chains; vocab 256000", unseen=True)
def gemma_bf16_train():
    model = hf("GemmaForCausalLM", "GemmaConfig", dtype=torch.bfloat16, vocab_size=256000, hidden_size=1024,
               intermediate_size=4096, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=1, head_dim=128)
    ids = torch.randint(0, 256000, (4, 512), device=DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    return lambda: train_step(model, {"input_ids": ids, "labels": ids}, opt)


@fixture("opt_fp16_infer", model="OPTForCausalLM", dtype="fp16", mode="inference", batch="8x512", attn="sdpa",
         plants="vocab 50272 (a multiple of 8, not of 64)", unseen=True)
def opt_fp16_infer():
    model = hf("OPTForCausalLM", "OPTConfig", dtype=torch.float16, vocab_size=50272, hidden_size=768,
               ffn_dim=3072, num_hidden_layers=2, num_attention_heads=12, word_embed_proj_dim=768).eval()
    ids = torch.randint(0, 50272, (8, 512), device=DEVICE)
    return torch.no_grad()(lambda: model(input_ids=ids).logits)


@fixture("llama_fp32_tf32_syncs_train", model="LlamaForCausalLM", dtype="fp32, TF32 on", mode="train, with "
         "loss.item() and a nonzero() inside every step", batch="4x256", attn="sdpa",
         plants="host syncs (.item(), nonzero); fp32 GEMMs on TF32 tensor cores must NOT be flagged FFMA", unseen=True)
def llama_fp32_tf32_syncs_train():
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.set_float32_matmul_precision("high")
    model = hf("LlamaForCausalLM", "LlamaConfig", **llama_cfg(num_hidden_layers=2))
    ids = torch.randint(0, 32000, (4, 256), device=DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        keep = torch.nonzero(ids[0] > 100)          # data-dependent shape: a sync
        return out.loss.item() + keep.shape[0]      # logging the loss: a sync
    return step


@fixture("qwen2_bf16_hidden900_infer", model="Qwen2ForCausalLM", dtype="bf16", mode="inference", batch="4x512",
         attn="sdpa", plants="hidden 900 / 12 heads: head_dim 75 and GEMM dims 900, 2400 not multiples of 8",
         unseen=True)
def qwen2_bf16_hidden900_infer():
    model = hf("Qwen2ForCausalLM", "Qwen2Config", dtype=torch.bfloat16, vocab_size=151936, hidden_size=900,
               intermediate_size=2400, num_hidden_layers=2, num_attention_heads=12, num_key_value_heads=4).eval()
    ids = torch.randint(0, 151936, (4, 512), device=DEVICE)
    return torch.no_grad()(lambda: model(input_ids=ids).logits)


@fixture("convnext_bf16_channels_last_infer", model="timm convnext_tiny", dtype="bf16, channels_last",
         mode="inference", batch="64x3x224x224", attn="-", plants="nothing planted: LayerNorm2d permutes", unseen=True)
def convnext_bf16_channels_last_infer():
    import timm
    model = timm.create_model("convnext_tiny", pretrained=False).to(DEVICE, torch.bfloat16).eval()
    model = model.to(memory_format=torch.channels_last)
    x = torch.randn(64, 3, 224, 224, device=DEVICE, dtype=torch.bfloat16).to(memory_format=torch.channels_last)
    return torch.no_grad()(lambda: model(x))


@fixture("distilbert_fp32_notf32_train", model="DistilBertForSequenceClassification", dtype="fp32, TF32 off",
         mode="train (fwd+bwd+SGD)", batch="16x256", attn="eager",
         plants="FFMA GEMMs (TF32 off), eager attention", unseen=True)
def distilbert_fp32_notf32_train():
    model = hf("DistilBertForSequenceClassification", "DistilBertConfig", attn="eager", n_layers=2)
    ids = torch.randint(0, 30522, (16, 256), device=DEVICE)
    labels = torch.randint(0, 2, (16,), device=DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    return lambda: train_step(model, {"input_ids": ids, "labels": labels}, opt)


# ---- the third set: one fixture per pricing defect the savings issue (#14) found ----------------

@fixture("gpt2_fp16_decode_b1", model="GPT2LMHeadModel", dtype="fp16", mode="greedy decode, 16 tokens per step, KV cache",
         batch="1 (prompt 32)", attn="sdpa",
         plants="the LM head is a memory-bound matrix-vector product (M=1) over vocab 50257: padding N buys nothing",
         third=True)
def gpt2_fp16_decode_b1():
    model = hf("GPT2LMHeadModel", "GPT2Config", dtype=torch.float16, n_layer=4, n_embd=1024, n_head=16).eval()
    prompt = torch.randint(0, 50257, (1, 32), device=DEVICE)

    @torch.no_grad()
    def step():
        out = model(input_ids=prompt, use_cache=True)
        past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        for _ in range(16):
            out = model(input_ids=tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
    return step


@fixture("gpt2_hidden1020_fp16_infer", model="GPT2LMHeadModel", dtype="fp16", mode="inference", batch="4x512",
         attn="sdpa", plants="hidden 1020 / 12 heads: head_dim 85 (SDPA pads q/k/v for its fused kernels), GEMM dims "
                             "1020, 3060, 4080 not all multiples of 8: one root cause behind several symptoms", third=True)
def gpt2_hidden1020_fp16_infer():
    # GPT-2 has no rotary embedding, which in Llama needs an even head_dim
    model = hf("GPT2LMHeadModel", "GPT2Config", dtype=torch.float16, n_layer=2, n_embd=1020, n_head=12,
               vocab_size=50304).eval()
    ids = torch.randint(0, 50304, (4, 512), device=DEVICE)
    return torch.no_grad()(lambda: model(input_ids=ids).logits)


# ---- driver -------------------------------------------------------------------------------

def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def reset_numerics():
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = True
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.enable_flash_sdp(True)
    torch.backends.cuda.enable_mem_efficient_sdp(True)
    torch.backends.cuda.enable_cudnn_sdp(True)


def capture(name, out_dir):
    fn, info = FIXTURES[name]
    if torch.cuda.is_available():
        reset_numerics()
    torch.manual_seed(0)
    step = fn()
    step()  # first call outside the profiler: cuBLAS handles, autotuning
    sync()
    path = os.path.join(out_dir, f"{name}.json")
    sched = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts, schedule=sched, record_shapes=True,
                                on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _ in range(4):
            step()
            sync()
            prof.step()
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    raw = os.path.getsize(path)
    os.remove(path)
    return raw, os.path.getsize(path + ".gz")


def capture_ddp(out_dir):
    """Two ranks of DDP GPT-2 training on one GPU (gloo), one trace per rank: a per-rank folder."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(rank)
    model = hf("GPT2LMHeadModel", "GPT2Config", n_layer=2, n_embd=768, n_head=12, vocab_size=50304)
    ddp = DDP(model)
    ids = torch.randint(0, 50304, (4, 256), device=DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    straggler = os.environ.get("STRAGGLER_RANK")
    delay_s = float(os.environ.get("STRAGGLER_MS", "0")) / 1e3

    def step():
        if straggler is not None and rank == int(straggler):
            time.sleep(delay_s)  # a rank with extra host work each step, so the test knows the answer
        train_step(ddp, {"input_ids": ids, "labels": ids}, opt)
    step()
    stem = "gpt2_ddp_straggler" if straggler is not None else "gpt2_ddp"
    path = os.path.join(out_dir, f"{stem}_rank{rank}.json")
    sched = torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts, schedule=sched, record_shapes=True,
                                on_trace_ready=lambda p: p.export_chrome_trace(path)) as prof:
        for _ in range(4):
            step()
            torch.cuda.synchronize()
            prof.step()
    with open(path, "rb") as src, gzip.open(path + ".gz", "wb", compresslevel=9) as dst:
        shutil.copyfileobj(src, dst)
    os.remove(path)
    dist.destroy_process_group()


def main():
    out_dir = sys.argv[1]
    if "RANK" in os.environ:
        return capture_ddp(out_dir)
    on_gpu = torch.cuda.is_available()
    names = sys.argv[2:] or [n for n, (_, info) in FIXTURES.items()
                             if info.get("cpu", False) != on_gpu and not info.get("unseen") and not info.get("third")]
    os.makedirs(out_dir, exist_ok=True)
    env = {"torch": torch.__version__, "cuda": torch.version.cuda,
           "gpu": torch.cuda.get_device_name() if on_gpu else None, "captured": time.strftime("%Y-%m-%d")}
    with contextlib.suppress(ImportError):
        import transformers
        env["transformers"] = transformers.__version__
    with contextlib.suppress(ImportError):
        import timm
        env["timm"] = timm.__version__
    with contextlib.suppress(ImportError):
        import torchvision
        env["torchvision"] = torchvision.__version__
    manifest = {"environment": env, "fixtures": {}}
    for name in names:
        t0 = time.time()
        try:
            raw, gz = capture(name, out_dir)
            manifest["fixtures"][name] = {**FIXTURES[name][1], "raw_bytes": raw, "gz_bytes": gz}
            print(f"ok   {name}: {raw/1e6:.1f} MB -> {gz/1e6:.2f} MB gz in {time.time()-t0:.0f}s", flush=True)
        except Exception:
            traceback.print_exc()
            print(f"FAIL {name}", flush=True)
        if on_gpu:
            torch.cuda.empty_cache()
        torch._dynamo.reset()
    manifest_path = os.path.join(out_dir, os.environ.get("MANIFEST", "manifest.json" if on_gpu else "manifest_cpu.json"))
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)


if __name__ == "__main__":
    main()
