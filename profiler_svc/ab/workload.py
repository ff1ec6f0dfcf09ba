"""Workloads named as "pkg.module:factory": how the CLI, the web queue and workers find a model."""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass

from ..errors import UserError
from ..formats import one_line
from ..workload_spec import split_workload_spec


@dataclass
class Workload:
    model: object  # torch.nn.Module
    inputs: object  # args tuple, kwargs dict, tensor or callable step(model)
    loss_fn: object = None  # loss_fn(output) -> scalar tensor, for training
    optimizer: object = None  # a torch.optim.Optimizer over the model's parameters: the step includes it


def load_workload(spec: str) -> Workload:
    """Import `pkg.module`, call `factory()`; it returns (model, inputs), (model, inputs, loss_fn) or
    (model, inputs, loss_fn, optimizer)."""
    module_name, attr = split_workload_spec(spec)
    # Like `python -m` and `flask --app`: a module in the current folder is importable.
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name and module_name.startswith(err.name):
            raise UserError(f"cannot import workload module {module_name!r} (run from the folder that "
                            "contains it, or install it)") from None
        raise UserError(f"workload module {module_name!r} needs {err.name!r}, which is not installed") from None
    except Exception as err:
        raise UserError(f"importing workload module {module_name!r} failed: {one_line(err)}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"workload module {module_name!r} has no callable {attr!r}")
    try:
        made = factory()
    except Exception as err:
        raise UserError(f"workload factory {spec} failed: {one_line(err)}") from None
    if not isinstance(made, tuple) or len(made) not in (2, 3, 4):
        raise UserError(f"workload factory {spec} must return (model, inputs), (model, inputs, loss_fn) or "
                        f"(model, inputs, loss_fn, optimizer), not {type(made).__name__}")
    import torch

    if not isinstance(made[0], torch.nn.Module):
        raise UserError(f"workload factory {spec} returned a {type(made[0]).__name__} as its model, "
                        "not a torch.nn.Module")
    if len(made) == 4 and not isinstance(made[3], torch.optim.Optimizer):
        raise UserError(f"workload factory {spec} returned a {type(made[3]).__name__} as its optimizer, "
                        "not a torch.optim.Optimizer")
    return Workload(*made)
