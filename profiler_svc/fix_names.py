"""The configuration fixes a recommendation can name and `profiler_svc ab --fix` applies: one list for the
detectors, the CLI and the A/B fix registry (profiler_svc.ab.fixes has exactly these, in this order).
Its own module, free of imports, so that the CLI can list them without loading the analyser or torch."""

FIX_NAMES = ("tf32", "bf16_autocast", "sdpa", "sdpa_backends", "fused_optimizer", "bundled_adamw", "pad_vocab",
             "cuda_graphs", "channels_last", "cudnn_benchmark", "use_cache")
# those that act on the optimizer, which steps only in a training step
OPTIMIZER_FIXES = ("fused_optimizer", "bundled_adamw")
