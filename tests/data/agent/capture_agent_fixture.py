"""Capture the agent fixture: a Llama training step recorded with ``profiler_svc.capture``.

Run on a CUDA machine with transformers installed, from this folder or with it on sys.path:

    python tests/data/agent/capture_agent_fixture.py OUT_DIR

The model is built from a config with random weights (nothing is downloaded). ``llama_bf16_train``
is also the workload factory (``capture_agent_fixture:llama_bf16_train``) that the A/B service
can re-run: it returns (model, inputs, loss_fn).
"""
import json
import os
import sys
import time

import torch

NAME = "llama_bf16_train_agent"
WORKLOAD = "capture_agent_fixture:llama_bf16_train"
CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=2,
              num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=4096)
BATCH, SEQ = 4, 512


def llama_bf16_train():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), device="cuda")
    return model, {"input_ids": ids, "labels": ids}, lambda out: out.loss


def main(out_dir):
    import transformers

    import profiler_svc
    model, inputs, loss_fn = llama_bf16_train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step():
        loss_fn(model(**inputs)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # outside the profiler: cuBLAS handles, autotuning
    torch.cuda.synchronize()
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, NAME + ".json.gz")
    with profiler_svc.capture(model, out=path, wait=1, warmup=1, active=2, workload=WORKLOAD) as cap:
        for _ in range(4):
            step()
            torch.cuda.synchronize()
            cap.step()
    provenance = {
        "name": NAME, "file": os.path.basename(cap.trace_path), "model": "LlamaForCausalLM", "config": CONFIG,
        "dtype": "bf16", "attn": "sdpa", "batch": f"{BATCH}x{SEQ}", "mode": "train (fwd+bwd+AdamW foreach)",
        "capture": "profiler_svc.capture(model, wait=1, warmup=1, active=2), cap.step() after each step",
        "workload": WORKLOAD, "torch": torch.__version__, "transformers": transformers.__version__,
        "cuda": torch.version.cuda, "gpu": torch.cuda.get_device_name(), "captured": time.strftime("%Y-%m-%d"),
        "gz_bytes": os.path.getsize(cap.trace_path),
    }
    with open(os.path.join(out_dir, NAME + ".provenance.json"), "w") as f:
        json.dump(provenance, f, indent=1)
    print(json.dumps(provenance))


if __name__ == "__main__":
    main(sys.argv[1])
