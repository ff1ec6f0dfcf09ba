"""What transformers' packed-sequence check costs a training step: the step of ab_end_to_end.py's "ours"
variant (the recommended swaps plus the fused linear cross-entropy), timed with and without the check.

    python benchmarks/hf_mask_sync.py [--family llama] [--rounds 12] [--out DIR]    (GPU)

Without an attention mask or a cache, transformers' `create_causal_mask` asks
`masking_utils.find_packed_sequence_indices` whether the position ids hold packed sequences, and reads the
answer on the host (`.all()` of a GPU tensor): a sync at the start of every forward. Arm B replaces that
function with one that answers "not packed" (`None`), which is what it returns for these inputs, so both
arms compute the same step. A and B alternate by round (ABAB, then BABA). Also recorded per arm: the host
time of one whole step and of the forward plus loss alone, each started on an idle GPU.
"""
import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch

import ab_end_to_end as E
from host_costs import host_us


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", choices=E.FAMILIES, default="llama")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = p.parse_args(argv)
    if args.rounds < 1:
        p.error(f"--rounds must be at least 1, got {args.rounds}")
    if not torch.cuda.is_available():
        print("benchmarks/hf_mask_sync.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import transformers.masking_utils as masking

    from profiler_svc.ab.stats import time_ms
    from profiler_svc.kernels import swap

    model = E.build(args.family, False)
    swap(model, ["rope", "rms_norm", E.FAMILIES[args.family][4]])
    ids, labels = E.batch(args.family, False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    dev = torch.device("cuda")

    def step():
        E.loss_of(model, ids, labels, True).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def host_ms(fn) -> float:  # one call, started on an idle GPU
        return host_us(fn, calls=1, warmup=0) / 1e3

    check = masking.find_packed_sequence_indices
    for _ in range(5):
        step()
    runs: dict = {f"{arm}_{what}": [] for arm in "AB" for what in ("step_ms", "host_step_ms", "host_forward_ms")}
    for r in range(args.rounds):
        for arm in ("AB" if r % 2 == 0 else "BA"):
            masking.find_packed_sequence_indices = check if arm == "A" else (lambda position_ids: None)
            runs[f"{arm}_step_ms"].append(time_ms(step, dev, steps=5))
            runs[f"{arm}_host_step_ms"].append(host_ms(step))
            runs[f"{arm}_host_forward_ms"].append(host_ms(lambda: E.loss_of(model, ids, labels, True)))
            opt.zero_grad(set_to_none=True)
    masking.find_packed_sequence_indices = check
    medians = {k: round(statistics.median(v), 2) for k, v in runs.items()}
    print(json.dumps(medians))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"hf_mask_sync_{args.family}.json").write_text(json.dumps(
        {"versions": E.versions(), "command": "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:]),
         "medians": medians, **runs}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
