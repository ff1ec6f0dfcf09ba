"""What share of the dense tensor-core peak cuBLAS's GEMMs reach on this GPU, by dtype and size.

The analyser prices a GEMM the trace shows no aligned tensor-core peer for (TF32 where it ran FFMA kernels, an
aligned size where it ran a low-alignment kernel) at a share of the device's dense peak. This measures that share
on the GEMM shapes of the models the project captures (hidden, MLP and vocabulary widths) at several token counts,
each shape a tight loop of one matmul timed by CUDA events (median of the repetitions, L2 warm as in a model's
loop), and the same for the odd vocabulary (50257 against 50304) with TF32 off and on.

    python benchmarks/gemm_efficiency.py --out OUT.json [--reps 20] [--dtypes tf32,bf16,fp16]
"""
import argparse
import json
import statistics

import torch

PEAK_TFLOPS = {"tf32": 494.0, "bf16": 989.0, "fp16": 989.0}  # H100 SXM / H200 dense datasheet figures
TOKENS = (256, 1024, 4096, 16384)
# (N, K): out x in of the Linear layers of GPT-2 (768), Llama-1B/Bar (2048, 5632), 7-8B (4096, 14336), a 70B
# width (8192), and LM heads (32000 x 2048, 50304 x 768, 128256 x 4096); both directions of the MLP
WIDTHS = ((768, 768), (3072, 768), (768, 3072), (2048, 2048), (5632, 2048), (2048, 5632), (4096, 4096),
          (14336, 4096), (4096, 14336), (8192, 8192), (32000, 2048), (50304, 768), (128256, 4096))
ODD_VOCAB = ((2048, 50257, 768), (2048, 50304, 768), (2048, 768, 50257), (2048, 768, 50304))  # (M, N, K)
MAX_OUTPUT_BYTES = 8 << 30


def time_matmul(a, b, reps: int) -> float:
    """Median µs of a @ b over REPS timed calls, after three untimed."""
    for _ in range(3):
        a @ b
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def operands(m, n, k, dtype):
    torch_dtype = torch.float32 if dtype in ("tf32", "fp32") else getattr(torch, {"bf16": "bfloat16", "fp16": "float16"}[dtype])
    a = torch.randn(m, k, device="cuda", dtype=torch_dtype)
    b = torch.randn(k, n, device="cuda", dtype=torch_dtype)
    return a, b


def measure(m, n, k, dtype, reps) -> dict:
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    a, b = operands(m, n, k, dtype)
    us = time_matmul(a, b, reps)
    flops = 2.0 * m * n * k
    row = {"dtype": dtype, "m": m, "n": n, "k": k, "flops": flops, "us": round(us, 2),
           "tflops": round(flops / us / 1e6, 1)}
    if dtype in PEAK_TFLOPS:
        row["share_of_peak"] = round(flops / us / 1e6 / PEAK_TFLOPS[dtype], 3)
    del a, b
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--dtypes", default="tf32,bf16,fp16")
    args = parser.parse_args()
    rows = []
    for dtype in args.dtypes.split(","):
        for m in TOKENS:
            for n, k in WIDTHS:
                if m * n * 4 > MAX_OUTPUT_BYTES:
                    continue
                rows.append(measure(m, n, k, dtype, args.reps))
                print(rows[-1], flush=True)
    odd = [measure(m, n, k, dtype, args.reps) for dtype in ("fp32", "tf32") for m, n, k in ODD_VOCAB]
    for row in odd:
        print(row, flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "command": "python benchmarks/gemm_efficiency.py " + " ".join(
               f"--{k} {v}" for k, v in vars(args).items() if k != "out")}
    with open(args.out, "w") as f:
        json.dump({"env": env, "peak_tflops": PEAK_TFLOPS, "rows": rows, "odd_vocab": odd}, f, indent=1)


if __name__ == "__main__":
    main()
