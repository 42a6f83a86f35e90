"""``build_adamw``: torch's AdamW (multi-tensor ``foreach`` kernels) without importing ``torch._dynamo``.

torch's optimizers import ``torch._dynamo`` (and with it sympy and the FX symbolic-shape machinery:
~75 MiB of resident memory per process) the first time ``add_param_group``, ``zero_grad``,
``state_dict``, ``load_state_dict`` or ``step`` runs: those methods are wrapped by
``torch._disable_dynamo`` / ``_use_grad_for_differentiable``, which import it to switch off a compiler
that eager training never starts. :class:`LeanAdamW` is ``torch.optim.AdamW`` with those methods'
undecorated bodies (the ``__wrapped__`` functions the decorators keep), ``step`` under
``torch.no_grad()`` as the decorator would run it: the same arithmetic, bit for bit, the same
``state_dict`` layout, a ``torch.optim.Optimizer`` for the schedulers. Where a torch version lacks one
of those ``__wrapped__`` functions, :func:`build_adamw` returns plain ``torch.optim.AdamW``.

``foreach=True`` on a CPU: a few multi-tensor kernels per step instead of ~10 ops per parameter. torch
chooses it by default only for CUDA parameters; on a CPU it is 1.6x faster here and gives the same
steps as the per-tensor loop, bit for bit. On CUDA parameters ``fused=True``: one kernel launch per
~hundreds of parameters and the step count on the device, where ``foreach`` reads each parameter's
step on the host (a 16-layer model's step made ~480 such reads and ~10 launches per tensor chunk).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import _get_scalar_dtype as _scalar_dtype

__all__ = ["LeanAdamW", "FlatAdamW", "build_adamw", "fused_capable"]

_METHODS = ("add_param_group", "zero_grad", "state_dict", "load_state_dict")
_KERNEL_KEYS = ("fused", "foreach", "capturable")  # this optimizer's choice, kept across load_state_dict


def _undecorated(cls: type, name: str) -> Callable | None:
    return getattr(getattr(cls, name, None), "__wrapped__", None)


_BODIES = {name: _undecorated(torch.optim.Optimizer, name) for name in _METHODS}
_STEP = _undecorated(torch.optim.AdamW, "step")


class LeanAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` whose methods never import ``torch._dynamo`` (see the module docstring)."""

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        _BODIES["add_param_group"](self, param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        _BODIES["zero_grad"](self, set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return _BODIES["state_dict"](self)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's load, keeping this optimizer's kernel choice: a saved group carries the ``fused`` /
        ``foreach`` / ``capturable`` of the run that wrote it (a CPU run's ``foreach``, a GPU run's
        ``fused``), and torch would take those over. The step counts go where the kept kernel reads them:
        on the parameter's device for ``fused`` / ``capturable``, on the CPU otherwise."""
        kept = [{k: group.get(k) for k in _KERNEL_KEYS} for group in self.param_groups]
        _BODIES["load_state_dict"](self, state_dict)
        for group, flags in zip(self.param_groups, kept, strict=True):
            group.update(flags)
            on_device = bool(group.get("fused") or group.get("capturable"))
            for p in group["params"]:
                state = self.state.get(p, {})
                step = state.get("step")
                if isinstance(step, Tensor):
                    state["step"] = step.to(device=p.device, dtype=torch.float32) if on_device else \
                        step.to(device="cpu", dtype=_scalar_dtype())

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        with torch.no_grad():  # what torch's _use_grad_for_differentiable sets (differentiable=False)
            return _STEP(self, closure)


def _zero_moments(numel: int, like: Tensor) -> tuple[Tensor, Tensor]:
    """Flat ``(numel,)`` zeros for ``exp_avg`` and ``exp_avg_sq`` in ``like``'s dtype and device."""
    exp_avg = torch.zeros(numel, dtype=like.dtype, device=like.device)
    return exp_avg, torch.zeros_like(exp_avg)


@dataclass(eq=False)
class _FlatState:
    """One param group's AdamW state in flat buffers: the per-parameter state entries are views of
    ``exp_avg`` / ``exp_avg_sq`` ``(numel,)`` and share one ``step`` tensor."""

    numels: list[int]
    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: Tensor


class FlatAdamW(LeanAdamW):
    """:class:`LeanAdamW` whose step on CPU parameters runs over flat buffers: one kernel per AdamW
    operation for a whole param group instead of one per parameter (torch's ``foreach`` ops loop over
    the tensors on a CPU). Per step the group's gradients and parameters are gathered into two flat
    temporaries (one ``cat`` each, after backward: no extra peak memory), the update runs on them with the operations of torch's
    multi-tensor AdamW in its order (elementwise, so every element gets the same arithmetic: the same
    steps bit for bit), and the parameters are copied back. The moments live in flat buffers whose
    views are the usual per-parameter ``state[p]`` entries; ``state_dict`` returns compact copies in
    torch's layout (it loads into ``torch.optim.AdamW`` and back).

    A group takes the flat path when its parameters share one CPU device and one real floating dtype,
    with the defaults AdamW keeps for them (no ``amsgrad``, ``maximize``, ``capturable``,
    ``differentiable``, ``fused``, a float ``lr``), and every parameter has a gradient at the step; a
    step where one has none, or state whose step counts differ, moves the group to torch's
    per-parameter path for good. GPU parameters always take torch's path (its ``foreach`` kernels are
    multi-tensor there)."""

    def __init__(self, params: Iterable[Tensor], **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self._flat: dict[int, _FlatState | None] = {}  # id(group) -> flat state; None: torch's path
        # the moments are allocated now, before any activation exists, so that they sit low in the heap
        # instead of between a step's freed activations; a group's state takes them at its first step
        self._reserved = {id(g): _zero_moments(sum(p.numel() for p in g["params"]), g["params"][0])
                          for g in self.param_groups if self._flat_capable(g)}

    def _flat_capable(self, group: dict[str, Any]) -> bool:
        params = group["params"]
        first = params[0] if params else None
        return (first is not None and first.device.type == "cpu" and first.dtype.is_floating_point
                and not any(group.get(k) for k in ("amsgrad", "maximize", "capturable", "differentiable", "fused"))
                and not isinstance(group["lr"], Tensor) and not any(isinstance(b, Tensor) for b in group["betas"])
                and all(p.device == first.device and p.dtype == first.dtype and not p.is_sparse for p in params)
                and len({id(p) for p in params}) == len(params))

    def _adopt(self, group: dict[str, Any]) -> _FlatState | None:
        """The group's flat state: built from zeros, or from the per-parameter state it holds (after a
        ``load_state_dict``); None (torch's path) where it cannot be flat."""
        params = group["params"]
        if not self._flat_capable(group):
            return None
        states = [self.state.get(p, {}) for p in params]
        numels = [p.numel() for p in params]
        exp_avg, exp_avg_sq = self._reserved.pop(id(group), (None, None))
        if exp_avg is None or exp_avg.numel() != sum(numels):
            exp_avg, exp_avg_sq = _zero_moments(sum(numels), params[0])
        step = torch.tensor(0.0, dtype=_scalar_dtype(), device="cpu")
        if any(states):
            keys = {"step", "exp_avg", "exp_avg_sq"}
            if not all(set(s) == keys for s in states):
                return None
            steps = {float(s["step"]) for s in states}
            if len(steps) != 1:
                return None
            torch.cat([s["exp_avg"].detach().reshape(-1) for s in states], out=exp_avg)
            torch.cat([s["exp_avg_sq"].detach().reshape(-1) for s in states], out=exp_avg_sq)
            step = states[0]["step"].detach().clone()
        flat = _FlatState(numels, exp_avg, exp_avg_sq, step)
        for p, a, b in zip(params, exp_avg.split(numels), exp_avg_sq.split(numels), strict=True):
            self.state[p] = {"step": step, "exp_avg": a.view_as(p), "exp_avg_sq": b.view_as(p)}
        return flat

    def _leave_flat(self, group: dict[str, Any]) -> None:
        """Give the group's parameters their own state tensors (torch's path from now on)."""
        for p in group["params"]:
            if p in self.state:
                self.state[p] = {k: (v.clone() if isinstance(v, Tensor) else v) for k, v in self.state[p].items()}
        self._flat[id(group)] = None

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        torch_path = False
        for group in self.param_groups:
            key = id(group)
            gradless = any(p.grad is None or p.grad.is_sparse for p in group["params"])
            if key not in self._flat:
                self._flat[key] = None if gradless else self._adopt(group)
                self._reserved.pop(key, None)  # taken by the flat state, or not needed on torch's path
            flat = self._flat[key]
            if flat is not None and gradless:
                self._leave_flat(group)
                flat = None
            if flat is None:
                torch_path = True
            else:
                with torch.no_grad():
                    _flat_adamw_step(group, flat)
        if torch_path:  # torch's per-parameter step over the groups that are not flat
            flat_groups = [g for g in self.param_groups if self._flat.get(id(g)) is not None]
            saved = [g["params"] for g in flat_groups]
            try:
                for g in flat_groups:
                    g["params"] = []
                LeanAdamW.step(self)
            finally:
                for g, ps in zip(flat_groups, saved, strict=True):
                    g["params"] = ps
        return loss

    def state_dict(self) -> dict[str, Any]:
        """torch's layout; the flat groups' entries as compact copies (not views of the flat buffers, nor
        one shared ``step``); the other groups' entries as torch returns them (no copy)."""
        out = super().state_dict()
        flat = {i for packed, group in zip(out["param_groups"], self.param_groups, strict=True)
                if self._flat.get(id(group)) is not None for i in packed["params"]}
        out["state"] = {i: ({k: (v.clone() if isinstance(v, Tensor) else v) for k, v in s.items()} if i in flat else s)
                        for i, s in out["state"].items()}
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        self._flat = {}  # rebuilt from the loaded per-parameter state at the next step


def _flat_adamw_step(group: dict[str, Any], flat: _FlatState) -> None:
    """torch's ``_multi_tensor_adam`` (decoupled weight decay, no amsgrad/maximize/capturable), each
    operation once over the group's flat buffers."""
    params = group["params"]
    lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
    # gathered per step: allocated after backward has freed the activations, they take no peak memory
    grad = torch.cat([p.grad.reshape(-1) for p in params])
    param = torch.cat([p.reshape(-1) for p in params])
    flat.step.add_(1.0)
    step = flat.step.item()
    if wd != 0:
        param.mul_(1 - lr * wd)
    flat.exp_avg.lerp_(grad, 1 - beta1)
    flat.exp_avg_sq.mul_(beta2)
    flat.exp_avg_sq.addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = (lr / bias_correction1) * -1
    denom = flat.exp_avg_sq.sqrt()
    denom.div_(bias_correction2 ** 0.5)
    denom.add_(eps)
    param.addcdiv_(flat.exp_avg, denom, value=step_size)
    del grad, denom
    torch._foreach_copy_(params, [v.view(p.shape) for v, p in zip(param.split(flat.numels), params, strict=True)])


def fused_capable(params: Iterable[Tensor | dict[str, Any]]) -> bool:
    """Whether torch's fused AdamW takes ``params`` (tensors or param groups): every one a floating
    CUDA tensor (one kernel per step for all of them, the step count kept on the device: no per-parameter
    launches and no host work per parameter). CPU parameters keep the flat ``foreach`` path, whose steps
    the pinned CPU loss curves hold bit for bit."""
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    return bool(tensors) and all(t.device.type == "cuda" and t.dtype.is_floating_point for t in tensors)


def build_adamw(params: Iterable[Tensor | dict[str, Any]], flat: bool = True, **kwargs: Any) -> torch.optim.AdamW:
    """AdamW over ``params`` with ``kwargs`` (lr, betas, eps, weight_decay): on CUDA parameters torch's
    fused kernel (``fused=True``, :func:`fused_capable`), elsewhere ``foreach=True`` kernels;
    :class:`FlatAdamW` (``flat=False``: :class:`LeanAdamW`, for parameters that are flat already, such
    as DeepSpeed's ZeRO partitions) where this torch version allows it, else ``torch.optim.AdamW``."""
    params = list(params)
    lean = _STEP is not None and all(_BODIES.values()) and not kwargs.get("differentiable", False)
    kind = (FlatAdamW if flat else LeanAdamW) if lean else torch.optim.AdamW
    if "fused" not in kwargs and "foreach" not in kwargs:
        kwargs["fused" if fused_capable(params) else "foreach"] = True
    return kind(params, **kwargs)
