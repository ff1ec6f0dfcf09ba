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
_MAX_PLANS = 64  # launch plans kept per optimizer; more means the tensors' storage keeps changing


@triton.jit
def _adamw_math(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt,
                MAXIMIZE: tl.constexpr):
    p, g, m, v = p.to(tl.float32), g.to(tl.float32), m.to(tl.float32), v.to(tl.float32)
    if MAXIMIZE:
        g = -g
    p = p - lr * weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - step_size * m / denom
    return p, m, v


@triton.jit
def _adamw_kernel(TABLE, GRADS, BLOCK_TENSOR, lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt,
                  DTYPE: tl.constexpr, MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(BLOCK_TENSOR + pid)
    row = TABLE + 5 * t  # parameter, exp_avg, exp_avg_sq addresses; size; the tensor's first block
    n = tl.load(row + 3)
    start = (pid - tl.load(row + 4)).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    # Addresses read from memory carry no alignment the compiler can see; every tensor here is 16-byte aligned
    # (checked on the host), and saying so lets the loads and stores vectorize.
    p_ptr = tl.multiple_of(tl.load(row).to(tl.pointer_type(DTYPE)), 16) + offs
    m_ptr = tl.multiple_of(tl.load(row + 1).to(tl.pointer_type(DTYPE)), 16) + offs
    v_ptr = tl.multiple_of(tl.load(row + 2).to(tl.pointer_type(DTYPE)), 16) + offs
    g_ptr = tl.multiple_of(tl.load(GRADS + t).to(tl.pointer_type(DTYPE)), 16) + offs
    if start + BLOCK <= n:  # a full block: no mask, whose unknown bound would keep the accesses scalar
        p, m, v = _adamw_math(tl.load(p_ptr), tl.load(g_ptr), tl.load(m_ptr), tl.load(v_ptr), lr, beta1, beta2,
                              eps, weight_decay, step_size, bias_correction2_sqrt, MAXIMIZE)
        tl.store(p_ptr, round_to(p, DTYPE))
        tl.store(m_ptr, round_to(m, DTYPE))
        tl.store(v_ptr, round_to(v, DTYPE))
    else:
        mask = offs < n
        p, m, v = _adamw_math(tl.load(p_ptr, mask=mask), tl.load(g_ptr, mask=mask), tl.load(m_ptr, mask=mask),
                              tl.load(v_ptr, mask=mask), lr, beta1, beta2, eps, weight_decay, step_size,
                              bias_correction2_sqrt, MAXIMIZE)
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
        self.table = torch.tensor(rows, dtype=torch.int64).to(device)
        self.block_tensor = torch.tensor(block_tensor, dtype=torch.int32).to(device)
        self.programs = len(block_tensor)


def _static_launchable(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor) -> bool:
    """Can the flat kernel update this parameter and its moments: dense, contiguous, 16-byte aligned, one dtype,
    on a device Triton runs on? (Its gradient is checked each step: autograd allocates it anew.)"""
    return (p.dtype in _PARAM_DTYPES and p.dtype == m.dtype == v.dtype
            and p.is_contiguous() and m.is_contiguous() and v.is_contiguous()
            and not (p.data_ptr() | m.data_ptr() | v.data_ptr()) & 15
            and p.numel() > 0 and (p.is_cuda or interpreted()))


class _Plan:
    """How one set of stepping tensors is updated: launches of the flat kernel, one per (device, dtype) with its
    tables, and the tensors left to torch ops. Built once; reused while the tensors' storage stays."""

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


def _eager_update(p, g, m, v, lr, beta1, beta2, eps, weight_decay, step, maximize) -> None:
    """The same update with torch ops, for a tensor the flat kernel does not take (strided, misaligned, on a CPU
    outside the interpreter): in fp32, rounded once to each tensor's dtype, as the kernel does."""
    p32, m32, v32 = p.float(), m.float(), v.float()
    g32 = -g.float() if maximize else g.float()
    p32.mul_(1 - lr * weight_decay)
    m32.mul_(beta1).add_(g32, alpha=1 - beta1)
    v32.mul_(beta2).addcmul_(g32, g32, value=1 - beta2)
    denom = (v32.sqrt() / math.sqrt(1 - beta2 ** step)).add_(eps)
    p32.addcdiv_(m32, denom, value=-lr / (1 - beta1 ** step))
    for t, t32 in ((p, p32), (m, m32), (v, v32)):
        if t32 is not t:  # .float() of an fp32 tensor is the tensor itself, already updated
            t.copy_(t32)


def adamw_step(params: list, grads: list, exp_avgs: list, exp_avg_sqs: list, step: float, *, lr: float,
               beta1: float, beta2: float, eps: float, weight_decay: float, maximize: bool = False,
               plans: dict | None = None) -> None:
    """One AdamW step of tensors at the same step count (`step`, counting this one): a launch per (device,
    dtype), torch ops for tensors the kernel cannot take. `plans` caches launch tables between calls."""
    plans = {} if plans is None else plans
    key = (tuple(map(torch.Tensor.data_ptr, params)), tuple(map(torch.Tensor.data_ptr, exp_avgs)),
           tuple(map(torch.Tensor.data_ptr, exp_avg_sqs)), tuple(map(torch.Tensor.numel, params)))
    plan = plans.get(key)
    if plan is None:
        if len(plans) >= _MAX_PLANS:
            plans.clear()
        plan = plans[key] = _Plan(params, exp_avgs, exp_avg_sqs)
    hyper = (lr, beta1, beta2, eps, weight_decay, step, maximize)
    for i in plan.eager:
        _eager_update(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], *hyper)
    for device, dtype, indices, grid in plan.launches:
        gs = [grads[i] for i in indices]
        addresses = [g.data_ptr() for g in gs]
        if any(g.dtype != dtype or not g.is_contiguous() for g in gs) or any(a & 15 for a in addresses):
            for i in indices:  # a gradient the kernel cannot read (another dtype, strided, misaligned)
                _eager_update(params[i], grads[i], exp_avgs[i], exp_avg_sqs[i], *hyper)
            continue
        # Pageable memory, non_blocking: the driver stages the few bytes at once, so this neither waits for the
        # GPU nor lets a later step overwrite them before they are read.
        grad_table = torch.tensor(addresses, dtype=torch.int64).to(device, non_blocking=True)
        with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
            launch(_adamw_kernel, (grid.programs,), grid.table, grad_table, grid.block_tensor,
                   float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
                   float(lr) / (1 - beta1 ** step), math.sqrt(1 - beta2 ** step),
                   DTYPE=_TRITON_DTYPES[dtype], MAXIMIZE=bool(maximize), BLOCK=BLOCK, num_warps=NUM_WARPS)


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


def _step_groups(optimizer: torch.optim.Optimizer, plans: dict, share_counters: bool) -> None:
    """Step every parameter group of an optimizer holding torch's AdamW state layout.

    With `share_counters`, tensors that step together share one step-count tensor (a CPU scalar, as torch keeps
    it outside its fused and capturable paths), so a step adds 1 once, not once per tensor; a tensor without a
    gradient this step gets a count of its own, which stays behind. Without it, each keeps its own, as torch's."""
    for group in optimizer.param_groups:
        for option in _UNSUPPORTED:
            if group.get(option):
                raise ValueError(f"profiler_svc's AdamW step does not support {option}=True")
        params, grads, exp_avgs, exp_avg_sqs, states, idle = [], [], [], [], [], []
        fresh = None
        for p in group["params"]:
            if p.grad is None:
                idle.append(p)
                continue
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            state = optimizer.state[p]
            if not state:
                if fresh is None or not share_counters:
                    fresh = torch.tensor(0.0, dtype=torch.float32)
                state["step"] = fresh
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            elif state["step"].device.type != "cpu":
                # loaded from torch's fused or capturable AdamW: read on the device, it would wait for the GPU
                state["step"] = state["step"].to("cpu", torch.float32)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            states.append(state)
        if not params:
            continue
        by_count = _count_steps(optimizer, states, idle) if share_counters else _count_own_steps(states)
        beta1, beta2 = group["betas"]
        for count, indices in by_count.items():
            pick = (lambda xs: xs) if len(by_count) == 1 else (lambda xs: [xs[i] for i in indices])
            adamw_step(pick(params), pick(grads), pick(exp_avgs), pick(exp_avg_sqs), count, lr=group["lr"],
                       beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                       maximize=group.get("maximize", False), plans=plans)


def _count_steps(optimizer, states: list, idle: list) -> dict:
    """Add this step to shared counters: {count after it: indices of the tensors at that count}."""
    counters: dict = {}
    for i, state in enumerate(states):
        counters.setdefault(id(state["step"]), []).append(i)
    for p in idle:  # a counter shared with a stepping tensor would carry this one along
        state = optimizer.state.get(p)
        if state and id(state["step"]) in counters:
            state["step"] = state["step"].clone()
    by_count: dict = {}
    for indices in counters.values():
        counter = states[indices[0]]["step"]
        count = counter.item() + 1
        if count not in by_count:
            counter.fill_(count)
            by_count[count] = ([], counter)
        shared = by_count[count]
        for i in indices:  # counters of equal value (separate ones, as loaded from torch's) become one
            states[i]["step"] = shared[1]
            shared[0].append(i)
    return {count: indices for count, (indices, _) in by_count.items()}


def _count_own_steps(states: list) -> dict:
    """Add this step to each tensor's own counter: {count after it: indices of the tensors at that count}."""
    steps = [state["step"] for state in states]
    torch._foreach_add_(steps, 1)
    by_count: dict = {}
    for i, count in enumerate(torch.stack(steps).tolist()):
        by_count.setdefault(count, []).append(i)
    return by_count


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
    """torch's step protocol: the closure (if any) evaluates the loss with gradients on, then the update."""
    loss = None
    if closure is not None:
        with torch.enable_grad():
            loss = closure()
    _step_groups(optimizer, plans, share_counters)
    return loss


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update (decoupled weight decay, no amsgrad) with one Triton launch per group."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, maximize: bool = False):
        _check_hyperparameters(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, maximize=maximize))
        self._plans: dict = {}

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
            return _closure_then_step(opt, closure, plans, share_counters=False)  # the user's checkpoints stay torch's

        optimizer.step = types.MethodType(torch.optim.Optimizer.profile_hook_step(step), optimizer)

    def remove(self) -> None:
        if self.previous is None:
            self.optimizer.__dict__.pop("step", None)
        else:
            self.optimizer.step = self.previous
        _counters_back_on_the_device(self.optimizer)


def use_bundled_step(optimizer) -> BundledStep:
    """Step an existing torch AdamW with the bundled kernel (its state carries on); `.remove()` undoes it."""
    return BundledStep(optimizer)
