"""Mixed precision at the engine boundary: the model computes in bf16, everything around it in fp32.

One setting, ``EngineSettings.precision`` (``training.precision`` in a config), for every engine:

- ``deepspeed`` at ZeRO 0: fp32 parameters and optimizer, the forward under bf16 autocast entered by
  hooks inside the module's call (:func:`autocast_inside_forward`: DeepSpeed's forward disables an
  autocast entered outside it, and its ``torch_autocast`` section reduces the gradients of every
  Linear in bf16 whatever ``communication_data_type`` says; its bf16 mode at ZeRO 0 steps
  AdamW on the bf16 weights without fp32 master weights, a 3% loss drift in 10 steps on an H100).
- ``deepspeed`` at ZeRO 1, 2: DeepSpeed's bf16 optimizer: the module's parameters are bf16, the
  optimizer keeps fp32 master weights and fp32 AdamW moments; gradients are reduced in
  ``deepspeed.communication_data_type`` (DeepSpeed's default for bf16 is bf16; ``"fp32"`` reduces
  them in fp32). DeepSpeed casts parameters only, buffers keep their dtype (graph edge attributes,
  coordinates): the layers cast such constant inputs to the dtype of their activations.
  The model casts its fp32 inputs to its parameters' dtype for compute and adds the carried state
  (residual prediction) in the inputs' dtype, so the rollout state is never rounded to bf16.
- ``ddp`` / ``local``: :func:`autocast` (``torch.autocast(device, bfloat16)``) around the forward;
  parameters, gradients, the gradient all-reduce and the optimizer stay fp32.

Either way the forward's floating outputs are returned in fp32 (:func:`cast_floating`), so the
loss, validation metrics and the rollout's carried state are computed in fp32, and the batch the
trainer reads (normalised inputs and targets) is never rounded to bf16.
Nothing is communicated here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

__all__ = ["cast_floating", "autocast", "compute_device_type", "autocast_inside_forward"]


def cast_floating(obj: Any, dtype: torch.dtype) -> Any:
    """``obj`` with every floating-point tensor (also inside tuples, lists and dicts) cast to ``dtype``;
    other objects and integer tensors unchanged."""
    if isinstance(obj, Tensor):
        return obj.to(dtype) if obj.is_floating_point() and obj.dtype != dtype else obj
    if isinstance(obj, tuple):
        return type(obj)(*(cast_floating(o, dtype) for o in obj)) if hasattr(obj, "_fields") else \
            tuple(cast_floating(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [cast_floating(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floating(v, dtype) for k, v in obj.items()}
    return obj


def compute_device_type(module: torch.nn.Module) -> str:
    """``"cuda"`` or ``"cpu"``: where ``module``'s parameters live (autocast's device type)."""
    for p in module.parameters():
        return p.device.type
    return "cpu"


@contextlib.contextmanager
def autocast(enabled: bool, device_type: str) -> Iterator[None]:
    """``torch.autocast(device_type, dtype=torch.bfloat16)`` when ``enabled``; nothing otherwise."""
    if not enabled:
        yield
        return
    with torch.autocast(device_type=device_type, dtype=torch.bfloat16):
        yield


def autocast_inside_forward(module: torch.nn.Module, device_type: str) -> None:
    """Run ``module``'s forward under bf16 autocast entered from inside its own call (forward hooks).

    DeepSpeed's forward switches off an autocast entered outside it; hooks on the module itself run
    inside that and win. Activation checkpointing recomputes under the autocast state of the forward.
    The exit hook runs even when the forward raises, so the autocast state never leaks."""
    active: list[torch.autocast] = []

    def enter(_module: torch.nn.Module, _args: Any) -> None:
        ctx = torch.autocast(device_type=device_type, dtype=torch.bfloat16)
        ctx.__enter__()
        active.append(ctx)

    def leave(_module: torch.nn.Module, _args: Any, _out: Any) -> None:
        active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
