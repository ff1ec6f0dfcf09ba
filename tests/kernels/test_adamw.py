"""The bundled AdamW against torch's fused AdamW (fp32 math, rounded once to the parameter's dtype, as ours)."""
import copy

import pytest
import torch

from profiler_svc.kernels import AdamW
from profiler_svc.kernels.adamw import BLOCK, bundled_step_refusal, use_bundled_step

# Tensors of one block, several blocks with a ragged end, and a multi-dimensional one.
SHAPES = [(33, 17), (2 * BLOCK + 5,), (5, 3, 2), (BLOCK,)]
ULP = {torch.float32: 2.0 ** -23, torch.bfloat16: 2.0 ** -7}


def make_params(dtype, seed=0, shapes=SHAPES):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen).to(dtype) for s in shapes]


def twins(values, n=2):
    return [[torch.nn.Parameter(v.clone()) for v in values] for _ in range(n)]


def run_steps(optimizers, param_sets, dtype, steps=4, seed=1, skip=None):
    """Give every set the same random gradients and step each optimizer; `skip(step, i)` leaves a tensor's
    gradient None that step."""
    gen = torch.Generator().manual_seed(seed)
    for step in range(steps):
        grads = [torch.randn(p.shape, generator=gen).to(p.device, dtype) for p in param_sets[0]]
        for params in param_sets:
            for i, (p, g) in enumerate(zip(params, grads)):
                p.grad = None if skip and skip(step, i) else g.clone()
        for opt in optimizers:
            opt.step()


def assert_close_in_ulps(ours, theirs, dtype, ulps):
    for a, b in zip(ours, theirs):
        scale = b.detach().float().abs().clamp_min(1.0)
        err = ((a.detach().float() - b.detach().float()).abs() / scale).max().item()
        assert err <= ulps * ULP[dtype], (a.shape, err / ULP[dtype])


def assert_same_bf16(ours, theirs, lr):
    """The same fp32 math rounded once to bf16: equal but for the rare element whose rounding flipped in some
    step (the flip carries into later steps through the moments), and that one within a step's update."""
    differing = sum(int((a != b).sum()) for a, b in zip(ours, theirs))
    assert differing <= 0.005 * sum(a.numel() for a in ours), differing
    for a, b in zip(ours, theirs):
        assert (a.detach().float() - b.detach().float()).abs().max().item() <= 2 * lr


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("maximize", [False, True])
def test_matches_torch_fused_adamw(dtype, maximize):
    theirs, ours = twins(make_params(dtype))
    kw = dict(lr=1e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, maximize=maximize)
    run_steps([torch.optim.AdamW(theirs, fused=True, **kw), AdamW(ours, **kw)], [theirs, ours], dtype)
    if dtype == torch.float32:
        assert_close_in_ulps(ours, theirs, dtype, 8)  # rounding order
    else:
        assert_same_bf16(ours, theirs, kw["lr"])
    moved = sum(int((a != b).sum()) for a, b in zip(ours, make_params(dtype)))
    assert moved > 0.9 * sum(p.numel() for p in ours)  # the steps changed the parameters: the test can tell


def test_groups_with_their_own_hyperparameters_and_gradients_that_skip_steps():
    dtype = torch.float32
    theirs, ours = twins(make_params(dtype))

    def groups(params):
        return [{"params": params[:2], "lr": 3e-2, "weight_decay": 0.0},
                {"params": params[2:], "lr": 1e-2, "weight_decay": 0.2}]
    # tensor 1 has no gradient on even steps: its step count falls behind the others', as in torch
    run_steps([torch.optim.AdamW(groups(theirs), fused=True), AdamW(groups(ours))], [theirs, ours], dtype,
              steps=5, skip=lambda step, i: i == 1 and step % 2 == 0)
    assert_close_in_ulps(ours, theirs, dtype, 8)


def test_step_counts_follow_torch_when_a_gradient_is_missing():
    theirs, ours = twins(make_params(torch.float32))
    ref, opt = torch.optim.AdamW(theirs, fused=True), AdamW(ours)
    run_steps([ref, opt], [theirs, ours], torch.float32, steps=5, skip=lambda step, i: i == 1 and step % 2 == 0)
    assert [opt.state[p]["step"].item() for p in ours] == [ref.state[p]["step"].item() for p in theirs]
    assert [opt.state[p]["step"].item() for p in ours] == [5.0, 2.0, 5.0, 5.0]


def test_strided_parameter_takes_the_torch_path_with_the_same_result():
    dtype = torch.float32
    values = make_params(dtype, shapes=[(40, 30), (300,)])
    theirs, ours = twins(values)
    # a transposed view as a parameter: the flat kernel cannot address it
    theirs[0] = torch.nn.Parameter(values[0].clone().t())
    ours[0] = torch.nn.Parameter(values[0].clone().t())
    assert not ours[0].is_contiguous()
    # and a view one element into its storage: 4-byte aligned, not the 16 bytes the kernel's loads assume
    theirs[1] = torch.nn.Parameter(torch.cat([values[1][:1], values[1]])[1:])
    ours[1] = torch.nn.Parameter(torch.cat([values[1][:1], values[1]])[1:])
    assert ours[1].data_ptr() % 16
    # torch's own per-tensor path as the reference: its fused CPU kernel pairs a transposed parameter with a
    # contiguous gradient element by element in memory order, which is not the same element
    run_steps([torch.optim.AdamW(theirs, foreach=False, lr=1e-2), AdamW(ours, lr=1e-2)], [theirs, ours], dtype)
    assert_close_in_ulps(ours, theirs, dtype, 8)


def test_checkpoints_move_between_torch_and_ours():
    dtype = torch.bfloat16
    a, b = twins(make_params(dtype))
    ref = torch.optim.AdamW(a, lr=1e-2, fused=True)
    run_steps([ref], [a], dtype, steps=2)
    for p, q in zip(a, b):
        q.data.copy_(p.data)
    opt = AdamW(b, lr=1e-2)
    opt.load_state_dict(copy.deepcopy(ref.state_dict()))  # as from a file: a live state dict shares its tensors
    run_steps([ref, opt], [a, b], dtype, steps=2, seed=7)
    assert_same_bf16(b, a, 1e-2)
    # and back again, into torch's per-tensor path: its keys and shapes are torch's, and each tensor's step count
    # its own (torch adds 1 to each count in its list)
    c = [torch.nn.Parameter(p.detach().clone()) for p in b]
    back = torch.optim.AdamW(c, lr=1e-2, foreach=True)
    back.load_state_dict(copy.deepcopy(opt.state_dict()))
    run_steps([back, opt], [c, b], dtype, steps=1, seed=8)
    assert [back.state[p]["step"].item() for p in c] == [5.0] * len(c)
    assert_same_bf16(b, c, 1e-2)


def test_new_parameter_storage_is_followed():
    """The launch tables hold addresses; a parameter given new storage (load_state_dict(assign=True), p.data =)
    must be updated where it now lives, not where it was."""
    dtype = torch.float32
    theirs, ours = twins(make_params(dtype))
    ref, opt = torch.optim.AdamW(theirs, lr=1e-2, fused=True), AdamW(ours, lr=1e-2)
    run_steps([ref, opt], [theirs, ours], dtype, steps=2)
    for p in ours:
        p.data = p.data.clone()
    run_steps([ref, opt], [theirs, ours], dtype, steps=2, seed=3)
    assert_close_in_ulps(ours, theirs, dtype, 8)


def kernel_steps(monkeypatch) -> list:
    """A list that grows by one for each group the bundled kernel steps."""
    from profiler_svc.kernels import adamw
    calls: list = []
    real = adamw.adamw_step
    monkeypatch.setattr(adamw, "adamw_step", lambda *a, **k: (calls.append(1), real(*a, **k)))
    return calls


def test_bundled_step_on_an_existing_optimizer_keeps_label_hooks_and_state(monkeypatch):
    calls = kernel_steps(monkeypatch)
    dtype = torch.float32
    theirs, ours = twins(make_params(dtype))
    ref = torch.optim.AdamW(theirs, lr=1e-2, fused=True)
    user = torch.optim.AdamW(ours, lr=1e-2)
    run_steps([ref, user], [theirs, ours], dtype, steps=2)
    hooked = []
    user.register_step_post_hook(lambda opt, args, kwargs: hooked.append(opt))
    bundled = use_bundled_step(user)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        run_steps([ref, user], [theirs, ours], dtype, steps=1, seed=5)
    names = {e.name for e in prof.events()}
    assert "Optimizer.step#AdamW.step" in names
    assert len(calls) == 1  # the bundled kernel stepped, not torch's own step
    assert hooked == [user]
    assert_close_in_ulps(ours, theirs, dtype, 8)
    bundled.remove()
    assert "step" not in user.__dict__
    run_steps([ref, user], [theirs, ours], dtype, steps=1, seed=6)  # torch's own step again, state carried on
    assert len(calls) == 1
    assert_close_in_ulps(ours, theirs, dtype, 8)
    assert user.state[ours[0]]["step"].item() == 4.0


@pytest.mark.parametrize("make, reason", [
    (lambda p: torch.optim.AdamW(p, amsgrad=True), "amsgrad"),
    (lambda p: torch.optim.Adam(p, weight_decay=0.1), "decoupled"),
    (lambda p: torch.optim.SGD(p, lr=0.1), "SGD is not torch.optim.AdamW"),
    (lambda p: AdamW(p), "already"),
])
def test_bundled_step_refuses_what_it_does_not_compute(make, reason):
    opt = make([torch.nn.Parameter(torch.zeros(3))])
    assert reason in bundled_step_refusal(opt)
    with pytest.raises(ValueError, match="does not apply"):
        use_bundled_step(opt)


def test_bad_hyperparameters_are_one_line_errors():
    p = [torch.nn.Parameter(torch.zeros(3))]
    for kw in ({"lr": -1.0}, {"betas": (1.0, 0.9)}, {"eps": -1.0}, {"weight_decay": -0.1},
               {"lr": torch.tensor(1e-3)}):
        with pytest.raises(ValueError) as err:
            AdamW(p, **kw)
        assert "\n" not in str(err.value)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_the_gpu_matches_torch_fused_adamw(dtype):
    theirs, ours = twins([v.cuda() for v in make_params(dtype, shapes=SHAPES + [(4096, 1024)])])
    run_steps([torch.optim.AdamW(theirs, lr=1e-2, fused=True), AdamW(ours, lr=1e-2)], [theirs, ours], dtype)
    if dtype == torch.float32:
        assert_close_in_ulps(ours, theirs, dtype, 8)
    else:
        assert_same_bf16(ours, theirs, 1e-2)


@cuda
def test_on_the_gpu_a_fused_optimizer_gets_its_device_step_counts_back():
    theirs, ours = twins([v.cuda() for v in make_params(torch.float32)])
    ref, user = torch.optim.AdamW(theirs, lr=1e-2, fused=True), torch.optim.AdamW(ours, lr=1e-2, fused=True)
    run_steps([ref, user], [theirs, ours], torch.float32, steps=2)
    bundled = use_bundled_step(user)
    run_steps([ref, user], [theirs, ours], torch.float32, steps=2, seed=4)
    assert user.state[ours[0]]["step"].device.type == "cpu"  # read on the host each step without a sync
    bundled.remove()
    assert user.state[ours[0]]["step"].device.type == "cuda"  # torch's fused step needs it there
    run_steps([ref, user], [theirs, ours], torch.float32, steps=1, seed=5)
    assert_close_in_ulps(ours, theirs, torch.float32, 8)


def test_a_closure_gives_the_loss_and_the_gradients_it_steps_on():
    theirs, ours = twins(make_params(torch.float32, shapes=[(7, 5)]))
    x = torch.randn(3, 7)

    def closure_for(params, opt):
        def closure():
            opt.zero_grad()
            loss = (x @ params[0]).square().sum()
            loss.backward()
            return loss
        return closure
    ref, opt = torch.optim.AdamW(theirs, lr=1e-2, fused=True), AdamW(ours, lr=1e-2)
    for _ in range(3):
        assert opt.step(closure_for(ours, opt)).item() == pytest.approx(ref.step(closure_for(theirs, ref)).item())
    assert_close_in_ulps(ours, theirs, torch.float32, 8)


def test_grad_scaler_unscales_and_skips_overflow_under_the_bundled_step():
    """torch's fused AdamW takes GradScaler's scale and inf flag into its own step; under the bundled step the
    scaler must unscale and skip an overflowing step itself, as with torch's own step."""
    results = []
    for bundled in (False, True):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 64))
        opt = torch.optim.AdamW([p], lr=1e-2, fused=True)
        installed = use_bundled_step(opt) if bundled else None
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale((p * float("inf")).sum()).backward()  # an overflow: skipped
        scaler.step(opt)
        scaler.update()
        assert not p.isnan().any()
        opt.zero_grad()
        scaler.scale((p * 3).sum()).backward()  # unscaled before the step
        scaler.step(opt)
        scaler.update()
        results.append((p.detach().clone(), opt.state[p]["step"].item()))
        if installed:
            installed.remove()
            assert opt._step_supports_amp_scaling is True  # torch's fused step takes the scaler's values again
    (theirs, their_steps), (ours, our_steps) = results
    assert our_steps == their_steps == 1.0
    assert_close_in_ulps([ours], [theirs], torch.float32, 8)


def test_torchs_keyword_arguments_are_taken():
    """The call site of torch.optim.AdamW needs only the class changed: implementation choices are ignored,
    steps it does not compute are refused in one line."""
    p = [torch.nn.Parameter(torch.zeros(3))]
    AdamW(p, lr=1e-3, amsgrad=False, foreach=True, fused=True, capturable=False, differentiable=False)
    for option in ("amsgrad", "capturable", "differentiable"):
        with pytest.raises(ValueError, match=f"does not support {option}=True"):
            AdamW(p, **{option: True})


def test_a_copied_or_unpickled_optimizer_steps():
    import pickle
    theirs, ours = twins(make_params(torch.float32))
    ref, opt = torch.optim.AdamW(theirs, lr=1e-2), AdamW(ours, lr=1e-2)
    run_steps([ref, opt], [theirs, ours], torch.float32, steps=2)
    copied = copy.deepcopy((ours, opt))
    unpickled = pickle.loads(pickle.dumps((ours, opt)))
    for params, optimizer in (copied, unpickled):
        twin_ref = copy.deepcopy((theirs, ref))
        run_steps([twin_ref[1], optimizer], [twin_ref[0], params], torch.float32, steps=1, seed=3)
        assert_close_in_ulps(params, twin_ref[0], torch.float32, 8)


def test_complex_and_fp64_parameters_follow_torch():
    for dtype in (torch.complex64, torch.float64):
        gen = torch.Generator().manual_seed(0)
        values = [torch.randn(40, generator=gen, dtype=dtype), torch.randn(3, 5, generator=gen, dtype=dtype)]
        theirs, ours = twins(values)
        ref, opt = torch.optim.AdamW(theirs, lr=1e-2, foreach=False), AdamW(ours, lr=1e-2)
        for step in range(3):
            for a, b in zip(theirs, ours):
                a.grad = torch.randn(a.shape, generator=gen, dtype=dtype)
                b.grad = a.grad.clone()
            ref.step()
            opt.step()
        for a, b in zip(ours, theirs):
            tolerance = 1e-12 if dtype == torch.float64 else 1e-5
            assert (a - b).abs().max().item() <= tolerance, (dtype, (a - b).abs().max().item())
        assert all(torch.view_as_real(b).std() > 0 if b.is_complex() else True for b in ours)


def kernel_device() -> str:
    """Where the flat kernel runs: the GPU, else the CPU under Triton's interpreter (else CPU tensors take torch's
    ops, and a test of the kernel's path has nothing to see)."""
    from profiler_svc.kernels._launch import interpreted
    if torch.cuda.is_available():
        return "cuda"
    if not interpreted():
        pytest.skip("the kernel runs on a GPU or under TRITON_INTERPRET=1")
    return "cpu"


def test_gradients_that_come_and_go_keep_one_launch_and_one_plan(monkeypatch):
    """Experts that get no tokens on some steps: their step counts fall behind, yet the group stays one launch a
    step over the same tables (the idle tensors skipped), and each tensor matches torch."""
    from profiler_svc.kernels import adamw
    launches = []
    real_launch = adamw.launch
    monkeypatch.setattr(adamw, "launch", lambda *a, **k: (launches.append(1), real_launch(*a, **k)))
    theirs, ours = twins([v.to(kernel_device()) for v in make_params(torch.float32)])
    ref, opt = torch.optim.AdamW(theirs, lr=1e-2, foreach=False), AdamW(ours, lr=1e-2)
    skip = lambda step, i: (step + i) % 3 == 0 and step > 0  # noqa: E731
    run_steps([ref, opt], [theirs, ours], torch.float32, steps=9, skip=skip)
    assert_close_in_ulps(ours, theirs, torch.float32, 8)
    assert [opt.state[p]["step"].item() for p in ours] == [ref.state[p]["step"].item() for p in theirs]
    assert len(set(opt.state[p]["step"].item() for p in ours)) > 1  # the counts did diverge
    assert len(launches) == 9 and len(opt._plans) == 1


def test_one_gradient_the_kernel_cannot_read_goes_to_torch_ops_alone(monkeypatch):
    from profiler_svc.kernels import adamw
    on_host = []
    real = adamw._eager_update
    monkeypatch.setattr(adamw, "_eager_update", lambda p, *a: (on_host.append(p.shape), real(p, *a)))
    device = kernel_device()
    theirs, ours = twins([v.to(device) for v in make_params(torch.float32, shapes=[(30, 40), (300,), (64,)])])
    ref, opt = torch.optim.AdamW(theirs, lr=1e-2, foreach=False), AdamW(ours, lr=1e-2)
    g = torch.randn(40, 30, device=device)
    theirs[0].grad, ours[0].grad = g.t().clone(), g.t()  # a strided gradient for one tensor
    for a, b in zip(theirs[1:], ours[1:]):
        a.grad = torch.randn(a.shape, device=device)
        b.grad = a.grad.clone()
    ref.step()
    opt.step()
    assert on_host == [torch.Size([30, 40])]
    assert_close_in_ulps(ours, theirs, torch.float32, 8)


def test_an_lr_scheduler_sees_the_bundled_step_as_the_optimizer_s():
    import warnings
    p = [torch.nn.Parameter(torch.zeros(3))]
    opt = torch.optim.AdamW(p, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    use_bundled_step(opt)
    p[0].grad = torch.ones(3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" would raise
        opt.step()
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)


def test_moments_on_another_device_than_the_parameter_are_refused_as_torch_refuses_them():
    """A state loaded onto one device for parameters on another (a CPU checkpoint, then model.cuda()): the kernel
    would read the moments at addresses of the wrong device; torch's ops raise instead (here a meta device stands
    in for the other one)."""
    p = torch.nn.Parameter(torch.ones(64))
    opt = AdamW([p], lr=1e-2)
    p.grad = torch.ones(64)
    opt.step()
    opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].to("meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grad_scaler_s_fused_protocol_with_half_parameters(dtype):
    """Pure fp16 training with GradScaler works only with an optimizer that takes the scaler's scale into its step
    (the scaler refuses to unscale fp16 gradients itself): torch's fused AdamW, the bundled step on it, and
    profiler_svc's AdamW must all do it, and agree; an overflowing step changes nothing."""
    results = []
    for make in (lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
                 lambda p: use_bundled_step(torch.optim.AdamW(p, lr=1e-2, fused=True)).optimizer,
                 lambda p: AdamW(p, lr=1e-2)):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 64, dtype=dtype))
        opt = make([p])
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        scaler.scale((p.float() * float("inf")).sum()).backward()
        scaler.step(opt)
        scaler.update()
        assert torch.equal(p.detach(), torch.linspace(-1, 1, 64, dtype=dtype))  # skipped
        opt.zero_grad()
        scaler.scale((p.float() * 3).sum()).backward()
        scaler.step(opt)
        scaler.update()
        results.append((p.detach().clone(), opt.state[p]["step"].item()))
    (theirs, steps), *others = results
    for ours, our_steps in others:
        assert our_steps == steps == 1.0
        assert torch.equal(ours, theirs)


def test_many_groups_keep_their_launch_tables():
    """Layer-wise learning rates: a group per layer. Each group's tables are built once, not every step."""
    from profiler_svc.kernels import adamw
    groups = [{"params": [torch.nn.Parameter(torch.randn(32))], "lr": 1e-3 * (i + 1)} for i in range(70)]
    opt = AdamW(groups)
    built = []
    real = adamw._Plan
    adamw._Plan = lambda *a: (built.append(1), real(*a))[1]
    try:
        for _ in range(3):
            for g in groups:
                g["params"][0].grad = torch.ones(32)
            opt.step()
    finally:
        adamw._Plan = real
    assert len(built) == 70


def test_an_old_checkpoint_s_numeric_step_is_taken():
    theirs, ours = twins(make_params(torch.float32))
    ref = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    run_steps([ref], [theirs], torch.float32, steps=2)
    saved = copy.deepcopy(ref.state_dict())
    for state in saved["state"].values():
        state["step"] = int(state["step"].item())  # as torch before 1.12 saved it
    for p, q in zip(theirs, ours):
        q.data.copy_(p.data)
    opt = AdamW(ours, lr=1e-2)
    opt.load_state_dict(saved)
    run_steps([ref, opt], [theirs, ours], torch.float32, steps=1, seed=4)
    assert_close_in_ulps(ours, theirs, torch.float32, 8)


def test_the_bundled_step_is_installed_once():
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))])
    use_bundled_step(opt)
    assert "already" in bundled_step_refusal(opt)
    with pytest.raises(ValueError, match="installed on it already"):
        use_bundled_step(opt)
