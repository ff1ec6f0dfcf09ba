"""A/B of swaps added on top of others, on ab_end_to_end.py's workload (bf16, 4 x 2048 tokens, one GPU):
the model with the BASE swaps is A, the same plus SWAPS is B; `profiler_svc.ab_test`'s paired, interleaved
rounds, its parity check against fp64, training (forward, HF loss, backward) then inference.

    python benchmarks/ab_on_top.py --out DIR [--family llama] [--base rope,rms_norm,swiglu]
                                   [--swaps residual_rms_norm] [--rounds 12] [--small]
"""
import argparse
import json
import os
import sys

import torch

from ab_end_to_end import FAMILIES, batch, build, versions


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--family", choices=FAMILIES, default="llama")
    parser.add_argument("--base", default="rope,rms_norm,swiglu")
    parser.add_argument("--swaps", default="residual_rms_norm")
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--small", action="store_true", help="a tiny config: a smoke test on any machine")
    args = parser.parse_args()
    from profiler_svc import ab_test
    from profiler_svc.kernels import available_swaps, swap

    base_names, swaps = ([s for s in names.split(",") if s] for names in (args.base, args.swaps))
    unknown = sorted(set(base_names + swaps) - set(available_swaps()))
    if unknown or not swaps:
        parser.exit(2, f"ab_on_top.py: {'unknown swaps ' + ', '.join(unknown) if unknown else 'no --swaps to test'} "
                       f"(available: {', '.join(available_swaps())})\n")
    if not (args.small or torch.cuda.is_available()):
        parser.exit(2, "ab_on_top.py needs a CUDA GPU (or --small)\n")
    model = build(args.family, args.small)
    ids, labels = batch(args.family, args.small)
    base = swap(model, base_names)
    out = {"versions": versions(), "family": args.family, "tokens": list(ids.shape),
           "base": sorted({row[2] for row in base.swapped}), "base_skipped": base.to_dict()["skipped"], "swaps": swaps}
    for mode in ("train", "infer"):
        if mode == "train":
            result = ab_test(model, lambda m: m(input_ids=ids, labels=labels), swaps, train=True, rounds=args.rounds)
        else:
            result = ab_test(model, {"input_ids": ids}, swaps, rounds=args.rounds)
        print(result.summary(), file=sys.stderr, flush=True)
        d = result.to_dict()
        d.pop("parity", None)
        out[mode] = d
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    try:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"ab_on_top_{args.family}.json"), "w") as f:
            json.dump(out, f, indent=1)
    except OSError as err:
        parser.exit(2, f"ab_on_top.py: cannot write to {args.out}: {err.strerror}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
