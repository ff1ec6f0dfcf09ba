"""torch.compile(fullgraph=True) goes through every op, forward and backward, without a graph break.

On the CPU the kernels run in Triton's interpreter, which torch.compile cannot trace into, so the ops
are opaque custom ops here (backend aot_eager); on a GPU they are triton_ops that Inductor sees into
(benchmarks/kernels.py checks that on the GPU).
"""
import pytest
import torch

from profiler_svc import kernels as K

TARGET = torch.randint(0, 100, (8,), generator=torch.Generator().manual_seed(0))

OPS = {
    "rms_norm": lambda x, w: K.rms_norm(x, w, 1e-6),
    "rms_norm_residual": lambda x, w: K.rms_norm(x, w, 1e-6, residual=x * 2)[0],
    "layer_norm": lambda x, w: K.layer_norm(x, w, w * 0.5, 1e-5),
    "softmax": lambda x, w: K.softmax(x * w),
    "cross_entropy": lambda x, w: K.cross_entropy(x * w, TARGET, label_smoothing=0.1),
    "cross_entropy_none": lambda x, w: K.cross_entropy(x * w, TARGET, reduction="none"),
    "fused_linear_cross_entropy": lambda x, w: K.fused_linear_cross_entropy(x, w[:, None] * x[:1] * 0.1, TARGET, chunk_rows=3),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_fullgraph_compile_matches_eager(name):
    fn = OPS[name]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(8, 100, generator=gen, requires_grad=True)
    w = torch.randn(100, generator=gen, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    out, ref = compiled(x, w), fn(x, w)
    torch.testing.assert_close(out, ref)
    for g, r in zip(torch.autograd.grad(out.sum(), [x, w]), torch.autograd.grad(ref.sum(), [x, w])):
        torch.testing.assert_close(g, r)
