"""AdamW (decoupled weight decay) in one Triton launch per parameter group: every tensor of the group in one grid.

AdamW reads a parameter, its gradient and both moments and writes three back; a bf16 parameter is 14 bytes, so
the step is a copy's worth of traffic and its floor is the copy's time. torch's fused AdamW reaches well below
that rate (benchmarks/adamw_bandwidth.py); a flat grid over all of a group's tensors keeps every block full.

Each program updates one block of one tensor: the tensors' addresses sit in a table on the device, built once
for the parameters and moments, and each step for the gradients (autograd allocates them anew). Math in fp32,
rounded once to the parameter's dtype, in the order of torch's fused kernel. The state is torch's (`step`,
`exp_avg`, `exp_avg_sq`), so checkpoints move between this optimizer and `torch.optim.AdamW` both ways.

    opt = profiler_svc.kernels.AdamW(model.parameters(), lr=1e-4)      # in place of torch.optim.AdamW
    profiler_svc.kernels.adamw.use_bundled_step(torch_adamw)            # or step an existing one with it
"""
from __future__ import annotations

import contextlib
import math
import types

import torch
import triton
import triton.language as tl

from ._launch import interpreted, launch, round_to

BLOCK = 1024
NUM_WARPS = 8
_PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_PLANS = 4  # launch plans kept per parameter group; more means the tensors' storage keeps changing


@triton.jit
def _adamw_math(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt, inv_grad_scale,
                MAXIMIZE: tl.constexpr):
    p, g, m, v = p.to(tl.float32), g.to(tl.float32) * inv_grad_scale, m.to(tl.float32), v.to(tl.float32)
    if MAXIMIZE:
        g = -g
    p = p - lr * weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - step_size * m / denom
    return p, m, v


@triton.jit
def _adamw_kernel(TABLE, GRADS, CORRECTIONS, BLOCK_TENSOR, lr, beta1, beta2, eps, weight_decay, step_size,
                  bias_correction2_sqrt, inv_grad_scale, DTYPE: tl.constexpr, MAXIMIZE: tl.constexpr,
                  PER_TENSOR: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(BLOCK_TENSOR + pid)
    g_address = tl.load(GRADS + t)
    if g_address != 0:  # 0: no gradient this step (or one the host updates itself): the tensor stays
        row = TABLE + 5 * t  # parameter, exp_avg, exp_avg_sq addresses; size; the tensor's first block
        n = tl.load(row + 3)
        start = (pid - tl.load(row + 4)).to(tl.int64) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        if PER_TENSOR:  # step counts that differ: lr / (1 - beta1^step) and sqrt(1 - beta2^step) per tensor
            step_size = tl.load(CORRECTIONS + 2 * t)
            bias_correction2_sqrt = tl.load(CORRECTIONS + 2 * t + 1)
        # Addresses read from memory carry no alignment the compiler can see; every tensor here is 16-byte
        # aligned (checked on the host), and saying so lets the loads and stores vectorize.
        p_ptr = tl.multiple_of(tl.load(row).to(tl.pointer_type(DTYPE)), 16) + offs
        m_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(DTYPE)), 16) + offs
        v_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(DTYPE)), 16) + offs
        g_ptr = tl.multiple_of(g_address.to(tl.pointer_type(DTYPE)), 16) + offs
        if start + BLOCK <= n:  # a full block: no mask, whose unknown bound would keep the accesses scalar
            p, m, v = _adamw_math(tl.load(p_ptr), tl.load(g_ptr), tl.load(m_ptr), tl.load(v_ptr), lr, beta1,
                                  beta2, eps, weight_decay, step_size, bias_correction2_sqrt, inv_grad_scale,
                                  MAXIMIZE)
            tl.store(p_ptr, round_to(p, DTYPE))
            tl.store(m_ptr, round_to(m, DTYPE))
            tl.store(v_ptr, round_to(v, DTYPE))
        else:
            mask = offs < n
            p, m, v = _adamw_math(tl.load(p_ptr, mask=mask), tl.load(g_ptr, mask=mask), tl.load(m_ptr, mask=mask),
                                  tl.load(v_ptr, mask=mask), lr, beta1, beta2, eps, weight_decay, step_size,
                                  bias_correction2_sqrt, inv_grad_scale, MAXIMIZE)
            tl.store(p_ptr, round_to(p, DTYPE), mask=mask)
            tl.store(m_ptr, round_to(m, DTYPE), mask=mask)
            tl.store(v_ptr, round_to(v, DTYPE), mask=mask)


_TRITON_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class _Grid:
    """The device tables of one launch: each tensor's parameter and moment addresses and size, and for each
    program the tensor and offset it updates. Built once for a set of tensors; reused while their storage stays."""

    def __init__(self, params, exp_avgs, exp_avg_sqs):
        device = params[0].device
        rows, block_tensor = [], []
        for t, (p, m, v) in enumerate(zip(params, exp_avgs, exp_avg_sqs)):
            n = p.numel()
            rows.append((p.data_ptr(), m.data_ptr(), v.data_ptr(), n, len(block_tensor)))
            block_tensor.extend([t] * triton.cdiv(n, BLOCK))
        self.table = _to_device(torch.tensor(rows, dtype=torch.int64), device)
        self.block_tensor = _to_device(torch.tensor(block_tensor, dtype=torch.int32), device)
        self.programs = len(block_tensor)


def _to_device(table: torch.Tensor, device: torch.device) -> torch.Tensor:
    # From pageable memory, non_blocking: the driver stages the bytes at once, so this neither waits for the GPU
    # nor lets a later step overwrite them before they are read.
    return table.to(device, non_blocking=True)


def _static_launchable(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> bool:
    """Can the flat kernel update this parameter and its moments: dense, contiguous, 16-byte aligned, one dtype,
    one device Triton runs on? (Its gradient is checked each step: autograd allocates it anew.)"""
    return (p.dtype in _PARAM_DTYPES and p.dtype == m.dtype == v.dtype and p.device == m.device == v.device
            and p.is_contiguous() and m.is_contiguous() and v.is_contiguous()
            and not (p.data_ptr() | m.data_ptr() | v.data_ptr()) & 15
            and p.numel() > 0 and (p.is_cuda or interpreted()))


class _Plan:
    """How a group's tensors (those with a state) are updated: launches of the flat kernel, one per (device, dtype)
    with its tables, and the tensors left to torch ops. Built once; reused while the tensors' storage stays."""

    def __init__(self, params, exp_avgs, exp_avg_sqs):
        members: dict = {}
        self.eager = []
        for i, (p, m, v) in enumerate(zip(params, exp_avgs, exp_avg_sqs)):
            if _static_launchable(p, m, v):
                members.setdefault((p.device, p.dtype), []).append(i)
            else:
                self.eager.append(i)
        self.launches = [(device, dtype, indices, _Grid([params[i] for i in indices], [exp_avgs[i] for i in indices],
                                                        [exp_avg_sqs[i] for i in indices]))
                         for (device, dtype), indices in members.items()]


def _eager_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, maximize, inv_grad_scale=1.0) -> None:
    """The same update with torch ops, for a tensor the flat kernel does not take (strided, misaligned, complex,
    fp64, on a CPU outside the interpreter): in fp32 (fp64 for fp64), rounded once to each tensor's dtype, as the
    kernel does; a complex tensor as its real and imaginary parts, as torch's AdamW."""
    if p.is_complex():
        p, g, m, v = (torch.view_as_real(t) for t in (p, g, m, v))
    math_dtype = torch.promote_types(p.dtype, torch.float32)
    p32, m32, v32, g32 = (t.to(math_dtype) for t in (p, m, v, g))
    if inv_grad_scale != 1.0:
        g32 = g32 * inv_grad_scale
    if maximize:
        g32 = -g32
    p32.mul_(1 - lr * weight_decay)
    m32.mul_(beta1).add_(g32, alpha=1 - beta1)
    v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
    denom = (v32.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    p32.addcdiv_(m32, denom, value=-lr / (1 - beta1 ** step))
    for t, t32 in ((p, p32), (m, m32), (v, v32)):
        if t32 is not t:  # .to() of a tensor already in the math dtype is the tensor itself, already updated
            t.copy_(t32)


def adamw_step(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, counts: list, *, lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool = False,
               inv_grad_scale: float = 1.0, plans: dict | None = None) -> None:
    """One AdamW step of a group's tensors: a launch per (device, dtype), torch ops for tensors the kernel cannot
    take. A tensor whose gradient is None stays as it is; `counts` holds each tensor's step count, this step
    included (None where it does not step); gradients are multiplied by `inv_grad_scale` (a GradScaler's 1/scale).
    `plans` caches this group's launch tables between calls."""
    plans = {} if plans is None else plans
    key = (tuple(map(torch.Tensor.data_ptr, params)), tuple(map(torch.Tensor.data_ptr, exp_avgs)),
           tuple(map(torch.Tensor.data_ptr, exp_avg_sqs)), tuple(map(torch.Tensor.numel, params)))
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plan = plans[key] = _Plan(params, exp_avgs, exp_avg_sqs)
    hyper = (lr, beta1, beta2, eps, weight_decay)

    def on_host(i):
        _eager_update(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], *hyper, counts[i], maximize, inv_grad_scale)

    for i in plan.eager:
        if grads[i] is not None:
            on_host(i)
    for device, dtype, indices, grid in plan.launches:
        gs = [grads[i] for i in indices]
        addresses = [0 if g is None else g.data_ptr() for g in gs]  # 0: the kernel skips the tensor
        for j, (g, address) in enumerate(zip(gs, addresses)):
            if address and (address & 15 or g.dtype != dtype or not g.is_contiguous()):
                on_host(indices[j])  # a gradient the kernel cannot read (misaligned, another dtype, strided): this one
                addresses[j] = 0
        live = {counts[i] for i, address in zip(indices, addresses) if address}
        if not live:
            continue
        # one step count (the usual case): its corrections as arguments; several: a table of them per tensor
        corrections = [_corrections(lr, beta1, beta2, counts[i]) if address else (0.0, 1.0)
                       for i, address in zip(indices, addresses)] if len(live) > 1 else None
        grad_table = _to_device(torch.tensor(addresses, dtype=torch.int64), device)
        table = grad_table if corrections is None else _to_device(torch.tensor(corrections, dtype=torch.float32), device)
        step_size, bias_correction2_sqrt = _corrections(lr, beta1, beta2, next(iter(live)))
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            launch(_adamw_kernel, (grid.programs,), grid.table, grad_table, table, grid.block_tensor,
                   float(lr), float(beta1), float(beta2), float(eps), float(weight_decay), step_size,
                   bias_correction2_sqrt, float(inv_grad_scale), DTYPE=_TRITON_DTYPES[dtype], MAXIMIZE=bool(maximize),
                   PER_TENSOR=corrections is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)


def _corrections(lr: float, beta1: float, beta2: float, count: float) -> tuple[float, float]:
    """Adam's bias corrections at a step count, as the kernel takes them: lr / (1 - beta1^count), sqrt(1 - beta2^count)."""
    return float(lr) / (1 - beta1 ** count), math.sqrt(1 - beta2 ** count)


def _check_hyperparameters(lr, betas, eps, weight_decay) -> None:
    if isinstance(lr, torch.Tensor):
        raise ValueError("profiler_svc AdamW takes lr as a number, not a tensor")
    if not 0.0 <= lr:
        raise ValueError(f"invalid learning rate: {lr}")
    if not 0.0 <= eps:
        raise ValueError(f"invalid epsilon value: {eps}")
    if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
        raise ValueError(f"invalid betas: {betas}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"invalid weight_decay value: {weight_decay}")


_UNSUPPORTED = ("amsgrad", "capturable", "differentiable")


def _step_groups(optimizer: torch.optim.Optimizer, plans: dict, share_counters: bool,
                 inv_grad_scale: float = 1.0) -> None:
    """Step every parameter group of an optimizer holding torch's AdamW state layout.

    Every tensor with a state is in the group's launch, so its tables stay the same from step to step; one without
    a gradient this step is skipped and its count stays behind. With `share_counters`, tensors that step together
    share one step-count tensor (a CPU scalar, as torch keeps it outside its fused and capturable paths), so a
    step adds 1 once, not once per tensor. Without it, each keeps its own, as torch's."""
    for index, group in enumerate(optimizer.param_groups):
        for option in _UNSUPPORTED:
            if group.get(option):
                raise ValueError(f"profiler_svc's AdamW step does not support {option}=True")
        params: list = []
        grads: list = []
        exp_avgs: list = []
        exp_avg_sqs: list = []
        states: list = []
        stepping: list = []
        fresh = None
        for p in group["params"]:
            g = p.grad
            state: dict = optimizer.state.get(p) or {}
            if g is None and not state:
                continue  # never stepped: no state to keep in the tables yet
            if g is not None:
                if g.is_sparse:
                    raise RuntimeError("AdamW does not support sparse gradients")
                if not state:
                    state = optimizer.state[p]
                    if fresh is None or not share_counters:
                        fresh = torch.tensor(0.0, dtype=torch.float32)
                    state["step"] = fresh
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                elif not torch.is_tensor(state["step"]):  # an old checkpoint's number, as torch's own converts it
                    state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
                elif state["step"].device.type != "cpu":
                    # loaded from torch's fused or capturable AdamW: read on the device, it would wait for the GPU
                    state["step"] = state["step"].to("cpu", torch.float32)
                stepping.append(len(params))
            params.append(p)
            grads.append(g)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            states.append(state)
        if not stepping:
            continue
        counts = (_count_shared_steps if share_counters else _count_own_steps)(states, stepping)
        beta1, beta2 = group["betas"]
        adamw_step(params, grads, exp_avgs, exp_avg_sqs, counts, lr=group["lr"], beta1=beta1, beta2=beta2,
                   eps=group["eps"], weight_decay=group["weight_decay"], maximize=group.get("maximize", False),
                   inv_grad_scale=inv_grad_scale, plans=plans.setdefault(index, {}))


def _count_shared_steps(states: list, stepping: list) -> list:
    """Add this step to shared counters; each tensor's count after it (None for one that does not step)."""
    counters: dict = {}
    for i in stepping:
        counters.setdefault(id(states[i]["step"]), []).append(i)
    moving = set(stepping)
    for i, state in enumerate(states):  # a counter shared with a stepping tensor would carry an idle one along
        if i not in moving and id(state["step"]) in counters:
            state["step"] = state["step"].clone()
    counts: list = [None] * len(states)
    shared: dict = {}  # count -> its counter
    for indices in counters.values():
        counter = states[indices[0]]["step"]
        count = counter.item() + 1
        if count not in shared:
            counter.fill_(count)
            shared[count] = counter
        for i in indices:  # counters of equal value (separate ones, as loaded from torch's) become one
            states[i]["step"] = shared[count]
            counts[i] = count
    return counts


def _count_own_steps(states: list, stepping: list) -> list:
    """Add this step to each stepping tensor's own counter; each tensor's count after it (None: not stepping)."""
    steps = [states[i]["step"] for i in stepping]
    torch._foreach_add_(steps, 1)
    counts: list = [None] * len(states)
    for i, count in zip(stepping, torch.stack(steps).tolist()):
        counts[i] = count
    return counts


def _counters_back_on_the_device(optimizer: torch.optim.Optimizer) -> None:
    """torch's fused and capturable steps keep each step count on its parameter's device: put back there the
    counts the bundled step read on the CPU."""
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable"):
            for p in group["params"]:
                state = optimizer.state.get(p)
                if state and "step" in state and state["step"].device != p.device:
                    state["step"] = state["step"].to(p.device)


@torch.no_grad()
def _closure_then_step(optimizer, closure, plans: dict, share_counters: bool):
    """torch's step protocol: the closure (if any) evaluates the loss with gradients on, then the update.

    Like torch's fused AdamW, it takes GradScaler's scale-aware protocol (`_step_supports_amp_scaling`): the
    scaler leaves the gradients scaled and sets `grad_scale` and `found_inf` on the optimizer; the step divides
    by the one and skips itself on the other. Reading them waits for the GPU once a step, as the scaler itself
    does for an optimizer without the protocol."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    grad_scale, found_inf = getattr(optimizer, "grad_scale", None), getattr(optimizer, "found_inf", None)
    inv_grad_scale = 1.0
    if grad_scale is not None or found_inf is not None:
        if found_inf is not None and found_inf.item():
            return loss  # an overflow: nothing changes, step counts included
        if grad_scale is not None:
            inv_grad_scale = 1.0 / grad_scale.item()
    _step_groups(optimizer, plans, share_counters, inv_grad_scale)
    return loss


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, no amsgrad) with one Triton launch per group."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False, foreach=None,
                 capturable: bool = False, differentiable: bool = False, fused=None):
        """torch.optim.AdamW's arguments, so that its call site needs only the class changed: `foreach` and `fused`
        (implementations) are ignored; amsgrad, capturable and differentiable steps are refused."""
        _check_hyperparameters(lr, betas, eps, weight_decay)
        for option, value in (("amsgrad", amsgrad), ("capturable", capturable), ("differentiable", differentiable)):
            if value:
                raise ValueError(f"profiler_svc's AdamW does not support {option}=True")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize))
        self._plans: dict = {}
        self._step_supports_amp_scaling = True  # GradScaler's scale and inf flag come into the step (as fused=True)

    def __setstate__(self, state):
        super().__setstate__(state)  # a copy or an unpickled optimizer: launch tables are built again
        self._plans = {}

    def step(self, closure=None):
        return _closure_then_step(self, closure, self._plans, share_counters=True)

    def state_dict(self):
        """torch's layout, each tensor with a step count of its own: torch's AdamW adds 1 to every count in its
        list, so counters shared here would each count many times there."""
        saved = super().state_dict()
        saved["state"] = {k: {**v, "step": v["step"].clone()} if "step" in v else dict(v)
                          for k, v in saved["state"].items()}
        return saved


def bundled_step_refusal(optimizer) -> str | None:
    """Why `use_bundled_step` cannot step this optimizer, or None: it must be torch's AdamW (or Adam with
    decoupled weight decay) without amsgrad, differentiable or capturable steps, or a learning rate as a tensor."""
    if isinstance(optimizer, AdamW):
        return "it is already profiler_svc's AdamW"
    if getattr(optimizer.__dict__.get("step"), "_bundled_adamw", False):
        return "the bundled step is installed on it already"
    if not isinstance(optimizer, torch.optim.Adam):  # torch's AdamW is an Adam with decoupled weight decay
        return f"{type(optimizer).__name__} is not torch.optim.AdamW"
    for group in optimizer.param_groups:
        if not (isinstance(optimizer, torch.optim.AdamW) or group.get("decoupled_weight_decay")):
            return "Adam without decoupled weight decay is not AdamW"
        for option in _UNSUPPORTED:
            if group.get(option):
                return f"the optimizer uses {option}=True"
        if isinstance(group["lr"], torch.Tensor):
            return "the learning rate is a tensor"
    return None


class BundledStep:
    """`optimizer.step` replaced by the bundled kernel on one optimizer instance, until `remove()`. The step
    keeps torch's profiler label and the optimizer's step hooks; on removal the step counts go back where torch's
    step keeps them."""

    def __init__(self, optimizer):
        reason = bundled_step_refusal(optimizer)
        if reason:
            raise ValueError(f"the bundled AdamW step does not apply: {reason}")
        self.optimizer = optimizer
        self.previous = optimizer.__dict__.get("step")  # an instance-level step (an LR scheduler's counter)
        plans: dict = {}

        def step(opt, closure=None):
            opt._opt_called = True  # what an LR scheduler's wrapper of the step it replaces records
            return _closure_then_step(opt, closure, plans, share_counters=False)  # the user's checkpoints stay torch's

        stepper = torch.optim.Optimizer.profile_hook_step(step)
        stepper._bundled_adamw = True  # bundled_step_refusal: installed once
        if getattr(self.previous, "_wrapped_by_lr_sched", False):
            stepper._wrapped_by_lr_sched = True  # the scheduler's mark; this step sets _opt_called, as its wrapper did
        optimizer.step = types.MethodType(stepper, optimizer)

    def remove(self) -> None:
        if self.previous is None:
            self.optimizer.__dict__.pop("step", None)
        else:
            self.optimizer.step = self.previous
        _counters_back_on_the_device(self.optimizer)


def use_bundled_step(optimizer) -> BundledStep:
    """Step an existing torch AdamW with the bundled kernel (its state carries on); `.remove()` undoes it."""
    return BundledStep(optimizer)
