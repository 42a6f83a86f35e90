"""Losses on grid-sharded outputs: area-weighted pointwise losses (MSE, MAE, Huber, log-cosh, RMSE) and
the almost-fair CRPS for ensembles.

Every rank of a model group holds a slice of the grid. Each loss sums its weighted errors over
the local slice, divides by the full-grid normaliser, and sums the partial losses over the model
group with :func:`stormshard.parallel.comm.reduce_tensor` (all-reduce forward, identity backward):
every rank then holds the same full loss, and the gradient each rank sends back is that of its own
slice. The loss is therefore the same number for every layout.

Weights: ``W[g, v] = area[g] * variable_weights[v]`` (the variable weights are the product of the
per-variable and pressure-level weights of :mod:`stormshard.models.loss_weights`). Missing targets:
an optional boolean ``mask`` (True = the target is valid, e.g. ``~isnan(target)``) removes the
masked points from both the sum and its normaliser, so the loss is the ``W``-weighted mean over
valid points; NaN targets at masked points are ignored (they reach neither the loss nor the
gradient). Without a mask the normaliser is ``batch * sum_g area * sum_v variable_weights``, the
same number.

Pointwise kinds (:data:`LOSS_KINDS`, ``training.loss``), of the error ``d = pred - target``, as
anemoi-training's losses of the same names compute them: ``mse`` ``d^2``; ``mae`` ``|d|``; ``huber``
``d^2 / 2`` where ``|d| < delta``, else ``delta (|d| - delta / 2)``; ``logcosh`` ``log cosh d`` (written
``|d| + softplus(-2|d|) - log 2``, finite for any ``d``; its gradient ``tanh d``); ``rmse`` the square root
of the full-grid weighted MSE (taken after the sum over the model group, so every layout gives the same
number).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from stormshard.parallel.comm import all_reduce_sum, reduce_tensor
from stormshard.training.loss_kinds import LOSS_KINDS, LossKind

__all__ = ["LOSS_KINDS", "LossKind", "WeightedPointwiseLoss", "WeightedMSELoss", "AlmostFairCRPSLoss",
           "almost_fair_crps", "pointwise_error"]



def pointwise_error(diff: Tensor, kind: str, delta: float = 1.0) -> Tensor:
    """The elementwise loss of the error ``diff = pred - target`` (any shape); ``rmse`` gives the squared
    error (its square root is taken after the weighted mean)."""
    if kind in ("mse", "rmse"):
        return diff.square()
    if kind == "mae":
        return diff.abs()
    if kind == "huber":
        a = diff.abs()
        return torch.where(a < delta, 0.5 * a.square(), delta * (a - 0.5 * delta))
    if kind == "logcosh":
        a = diff.abs()
        return a + F.softplus(-2.0 * a) - math.log(2.0)
    raise ValueError(f"unknown loss kind {kind!r}: use one of {', '.join(LOSS_KINDS)}")


def _check_mask(mask: Tensor | None, target: Tensor) -> None:
    if mask is None:
        return
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool tensor (True = valid target), got {mask.dtype}")
    # the broadcast rule by hand: torch.broadcast_shapes imports sympy (~20 MiB resident) on first use
    pairs = zip(reversed(mask.shape), reversed(target.shape), strict=False)  # trailing dims, as broadcasting aligns
    if not all(m == t or m == 1 or t == 1 for m, t in pairs):
        raise ValueError(f"mask of shape {tuple(mask.shape)} does not broadcast to the target's "
                         f"{tuple(target.shape)}")


def _masked_normaliser(mask: Tensor, area: Tensor, vw: Tensor, shape: torch.Size, group) -> Tensor:  # noqa: ANN001
    """``sum_{b,g,v} mask * area_g * w_v`` over the full grid (all-reduced over ``group``), detached."""
    w = area[:, None] * vw[None, :]  # (grid_local, variables)
    local = (mask.expand(shape) * w).sum().detach().reshape(1)
    return all_reduce_sum(local, group)[0].clamp_min(torch.finfo(local.dtype).tiny)


def _check_weights(name: str, weights: Tensor, size: int, what: str) -> None:
    if weights.dim() != 1 or weights.shape[0] != size:
        raise ValueError(f"{name} has shape {tuple(weights.shape)} but the {what} has {size} entries: pass one weight per entry")


class WeightedPointwiseLoss(nn.Module):
    """A pointwise loss (``kind``, see :data:`LOSS_KINDS`) weighted by node area and per variable, over a
    sharded grid.

    ``loss = sum_{b,g,v} a_g w_v f(pred - target) / (B * sum_g a_g * sum_v w_v)`` where the grid sums
    run over the full grid (all ranks of ``model_comm_group``); with a ``mask``
    ``loss = sum m a_g w_v f(pred - target) / sum m a_g w_v`` (masked points skipped). ``rmse``: the
    square root of that with ``f = d^2``.

    Args:
        variable_weights: ``(variables,)`` per-variable weights.
        kind: ``mse`` (default), ``mae``, ``huber``, ``logcosh`` or ``rmse``.
        delta: the Huber threshold (``huber`` only), positive.
    Forward:
        pred, target: ``(batch, [ensemble,] grid_local, variables)``;
        area_weights: ``(grid_local,)`` this rank's node weights (any positive scale);
        mask: optional bool, broadcastable to ``target`` (True = valid).
    Communicates: two scalar all-reduces over the model group (the normaliser and the loss).
    """

    def __init__(self, variable_weights: Tensor, kind: str = "mse", delta: float = 1.0) -> None:
        super().__init__()
        if variable_weights.dim() != 1 or (variable_weights < 0).any():
            raise ValueError("variable_weights must be a 1-d tensor of non-negative weights, one per output variable")
        if kind not in LOSS_KINDS:
            raise ValueError(f"unknown loss kind {kind!r}: use one of {', '.join(LOSS_KINDS)}")
        if not (math.isfinite(delta) and delta > 0):
            raise ValueError(f"the Huber delta must be a positive number, got {delta}")
        self.kind, self.delta = kind, float(delta)
        self.register_buffer("variable_weights", variable_weights.clone(), persistent=False)

    def forward(self, pred: Tensor, target: Tensor, area_weights: Tensor, model_comm_group=None,  # noqa: ANN001
                mask: Tensor | None = None) -> Tensor:
        if pred.shape != target.shape:
            raise ValueError(f"pred has shape {tuple(pred.shape)} but target has {tuple(target.shape)}")
        _check_weights("variable_weights", self.variable_weights, pred.shape[-1], "last (variable) dimension")
        _check_weights("area_weights", area_weights, pred.shape[-2], "local grid")
        _check_mask(mask, target)
        if mask is not None:
            vw = self.variable_weights.to(pred.dtype)
            area = area_weights.to(pred.dtype)
            target = torch.where(mask, target, torch.zeros((), dtype=target.dtype, device=target.device))
            err = torch.where(mask, pointwise_error(pred - target, self.kind, self.delta),
                              torch.zeros((), dtype=pred.dtype, device=pred.device))
            local = (err * vw * area[:, None]).sum()
            local = local / _masked_normaliser(mask, area, vw, pred.shape, model_comm_group)
        else:
            area_total = all_reduce_sum(area_weights.sum().detach().reshape(1), model_comm_group)[0]
            vw = self.variable_weights.to(pred.dtype)
            err = pointwise_error(pred - target, self.kind, self.delta) * vw
            per_node = err.sum(dim=-1)  # (..., grid_local)
            local = (per_node * area_weights.to(pred.dtype)).sum()
            samples = per_node.numel() // per_node.shape[-1]
            local = local / (samples * area_total * vw.sum())
        total = reduce_tensor(local, model_comm_group)
        return total.sqrt() if self.kind == "rmse" else total


class WeightedMSELoss(WeightedPointwiseLoss):
    """:class:`WeightedPointwiseLoss` of kind ``mse``: the area- and variable-weighted mean squared error."""

    def __init__(self, variable_weights: Tensor) -> None:
        super().__init__(variable_weights, "mse")


def almost_fair_crps(ensemble: Tensor, target: Tensor, alpha: float = 0.95) -> Tensor:
    """Pointwise almost-fair CRPS of Lang et al. (2024), ``alpha * fCRPS + (1 - alpha) * CRPS``.

    ensemble: ``(..., members, grid, variables)``; target: ``(..., grid, variables)``.
    Returns ``(..., grid, variables)``. With ``alpha = 1`` this is the fair CRPS.
    """
    members = ensemble.shape[-3]
    if members < 2:
        raise ValueError(f"the almost-fair CRPS needs at least 2 ensemble members, got {members}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    skill = (ensemble - target.unsqueeze(-3)).abs().mean(dim=-3)
    pairwise = (ensemble.unsqueeze(-3) - ensemble.unsqueeze(-4)).abs().sum(dim=(-3, -4))
    m = float(members)
    spread_coeff = (m - 1.0 + alpha) / (2.0 * m * m * (m - 1.0))
    return skill - spread_coeff * pairwise


class AlmostFairCRPSLoss(nn.Module):
    """Area- and variable-weighted almost-fair CRPS over a sharded grid.

    Forward: ensemble ``(batch, members, grid_local, variables)`` (all members of one initial state:
    gather members spread over ranks first), target ``(batch, grid_local, variables)``,
    area_weights ``(grid_local,)``, optional mask (bool, broadcastable to target, True = valid):
    masked points are skipped as in :class:`WeightedMSELoss`. Communicates like it.
    """

    def __init__(self, variable_weights: Tensor, alpha: float = 0.95) -> None:
        super().__init__()
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
        self.alpha = alpha
        self.register_buffer("variable_weights", variable_weights.clone(), persistent=False)

    def forward(self, ensemble: Tensor, target: Tensor, area_weights: Tensor, model_comm_group=None,  # noqa: ANN001
                mask: Tensor | None = None) -> Tensor:
        if ensemble.dim() != 4 or target.dim() != 3 or ensemble.shape[0] != target.shape[0] \
                or ensemble.shape[2:] != target.shape[1:]:
            raise ValueError(
                f"ensemble must be (batch, members, grid, variables) and target (batch, grid, variables); "
                f"got {tuple(ensemble.shape)} and {tuple(target.shape)}"
            )
        _check_weights("variable_weights", self.variable_weights, target.shape[-1], "last (variable) dimension")
        _check_weights("area_weights", area_weights, target.shape[-2], "local grid")
        _check_mask(mask, target)
        if mask is not None:
            vw, area = self.variable_weights.to(ensemble.dtype), area_weights.to(ensemble.dtype)
            target = torch.where(mask, target, torch.zeros((), dtype=target.dtype, device=target.device))
            crps = almost_fair_crps(ensemble, target, self.alpha)
            crps = torch.where(mask, crps, torch.zeros((), dtype=crps.dtype, device=crps.device))
            local = (crps * vw * area[:, None]).sum()
            local = local / _masked_normaliser(mask, area, vw, target.shape, model_comm_group)
            return reduce_tensor(local, model_comm_group)
        area_total = all_reduce_sum(area_weights.sum().detach().reshape(1), model_comm_group)[0]
        vw = self.variable_weights.to(ensemble.dtype)
        crps = almost_fair_crps(ensemble, target, self.alpha) * vw  # (batch, grid, variables)
        local = (crps.sum(dim=-1) * area_weights.to(ensemble.dtype)).sum()
        local = local / (target.shape[0] * area_total * vw.sum())
        return reduce_tensor(local, model_comm_group)


