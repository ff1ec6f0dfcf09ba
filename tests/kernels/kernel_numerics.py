"""Shared numerics check for the kernel tests: error vs an fp64 reference, ours against eager's.

Error is ‖out − ref‖ / ‖ref‖ (relative, in the norm: stable from run to run, unlike the max), for the
output and for every input gradient. A kernel passes when each of its errors is at most SLACK times
the best baseline's on the very same inputs, plus eps(dtype)/sqrt(numel): the error of a few values
(a bias gradient of N=1) is one or two roundings, won or lost by luck; over many values it averages out.
"""
import torch

SLACK = 1.1


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    ref = ref.double()
    return ((out.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def errors(fn, inputs64, reference, dtype, dy_seed=0) -> list[tuple[float, int]]:
    """[(error, numel)] for the output, then each input that requires grad, of fn in `dtype` vs fp64."""
    gen = torch.Generator().manual_seed(dy_seed)
    ref_in = [t.detach().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t for t in inputs64]
    ref_out = reference(*ref_in)
    # The incoming gradient is representable in `dtype`, so every candidate gets exactly the same one
    # whatever its output dtype (a loss may come back in fp32 from bf16 logits).
    dy = torch.randn(ref_out.shape, generator=gen, dtype=torch.float64).to(dtype).double().to(ref_out.device)
    need = [t for t in ref_in if isinstance(t, torch.Tensor) and t.requires_grad]
    ref_grads = torch.autograd.grad(ref_out, need, dy) if need else []
    run_in = [
        t.detach().to(dtype if t.is_floating_point() else t.dtype).requires_grad_(t.requires_grad)
        if isinstance(t, torch.Tensor) else t
        for t in inputs64
    ]
    out = fn(*run_in)
    run_need = [t for t in run_in if isinstance(t, torch.Tensor) and t.requires_grad]
    grads = torch.autograd.grad(out, run_need, dy.to(out.dtype)) if run_need else []
    return [(rel_err(out, ref_out), out.numel())] + [(rel_err(g, r), g.numel()) for g, r in zip(grads, ref_grads)]


def assert_no_worse(ours, baselines: dict, inputs64, reference, dtype) -> None:
    mine = errors(ours, inputs64, reference, dtype)
    theirs = {name: errors(fn, inputs64, reference, dtype) for name, fn in baselines.items()}
    for i, (err, numel) in enumerate(mine):
        best = min(errs[i][0] for errs in theirs.values())
        floor = torch.finfo(dtype).eps / numel**0.5
        what = "forward" if i == 0 else f"grad {i}"
        assert err == err and err <= SLACK * best + floor, f"{what}: ours {err:.3g} vs best eager {best:.3g} ({theirs})"


# Inputs in several dtypes (a residual or a weight in another dtype than x): `errors` casts every input to one
# dtype; here each keeps its own. Ours and eager run on the very same tensors, the fp64 reference on their exact
# values; each output and input gradient of ours must come in eager's dtype and shape, match eager's within its
# dtype's rounding, and have an error at most SLACK times eager's plus eps(its dtype)/sqrt(numel).
def _outputs_and_grads(fn, inputs, dys) -> list[torch.Tensor]:
    run_in = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*run_in)
    # each incoming gradient is rounded to its output's dtype: ours, eager and the reference take the same one
    return list(out) + list(torch.autograd.grad(out, run_in, [dy.to(o.dtype) for dy, o in zip(dys, out)]))


def assert_mixed_no_worse(ours, eager, reference, inputs, seed=0) -> None:
    """OURS, EAGER: fn(*inputs) -> a tuple of outputs; REFERENCE: the same function, run in fp64."""
    ref_in = [t.detach().double().requires_grad_() for t in inputs]
    ref_out = reference(*ref_in)
    gen = torch.Generator().manual_seed(seed)
    dys = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in ref_out]
    theirs = _outputs_and_grads(eager, inputs, dys)
    mine = _outputs_and_grads(ours, inputs, dys)
    ref_dys = [dy.to(o.dtype).double() for dy, o in zip(dys, theirs)]
    expected = list(ref_out) + list(torch.autograd.grad(ref_out, ref_in, ref_dys))
    for i, (got, base, ref) in enumerate(zip(mine, theirs, expected)):
        what = f"output {i}" if i < len(ref_out) else f"grad {i - len(ref_out)}"
        assert (got.dtype, got.shape) == (base.dtype, base.shape), f"{what}: ours {got.dtype}, eager {base.dtype}"
        torch.testing.assert_close(got, base, msg=lambda m: f"{what}: {m}")
        err, best = rel_err(got, ref), rel_err(base, ref)
        floor = torch.finfo(base.dtype).eps / base.numel() ** 0.5
        assert err == err and err <= SLACK * best + floor, f"{what}: ours {err:.3g} vs eager {best:.3g}"
