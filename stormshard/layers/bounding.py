"""Output boundings: physical limits on the predicted variables, anemoi-models' ``layers/bounding.py`` kinds.

Applied to the normalised prediction ``(batch, grid_local, output_variables)`` after the residual, one bounding
after the other in the order they are listed; each reads and writes only its own columns (and a fraction reads
its total's), per grid point, so a sharded grid needs no communication. Built from
:class:`BoundingSpec` (the model config's ``BoundingConfig``) and the output variable names; every bounding is out of place
(the input is not modified, autograd sees plain functions).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["OutputBounding", "BoundingSpec", "leaky_hardtanh"]


class BoundingSpec(Protocol):
    """What a bounding needs (:class:`stormshard.models.config.BoundingConfig` is one; layers import no model)."""

    kind: str
    variables: tuple[str, ...]
    min_val: float | None
    max_val: float | None
    total_variable: str | None
    thresholds: tuple[float, ...] | None

#: the slope the leaky kinds keep outside their bounds (torch's and anemoi's default)
LEAKY_SLOPE = 0.01


def leaky_hardtanh(x: Tensor, min_val: float, max_val: float, slope: float = LEAKY_SLOPE) -> Tensor:
    """``x`` clamped to ``[min_val, max_val]``, with slope ``slope`` (not 0) below and above."""
    clamped = x.clamp(min_val, max_val)
    return clamped + slope * (x - clamped)


def _bound(spec: BoundingSpec, x: Tensor, thresholds: Tensor | None) -> Tensor:
    """One bounding of the selected columns ``x`` ``(..., len(spec.variables))`` (fractions: before the product)."""
    kind = spec.kind
    if kind == "relu":
        return F.relu(x)
    if kind == "leaky_relu":
        return F.leaky_relu(x, LEAKY_SLOPE)
    if kind == "normalized_relu":
        return F.relu(x - thresholds) + thresholds
    if kind == "normalized_leaky_relu":
        return F.leaky_relu(x - thresholds, LEAKY_SLOPE) + thresholds
    if kind in ("hardtanh", "fraction"):
        return F.hardtanh(x, spec.min_val, spec.max_val)
    return leaky_hardtanh(x, spec.min_val, spec.max_val)  # leaky_hardtanh, leaky_fraction


class OutputBounding(nn.Module):
    """``specs`` applied in order to ``(..., output_variables)`` tensors whose last axis follows ``output_names``.

    Raises ValueError naming ``model.bounding`` when a variable (or a fraction's total) is not an output variable.
    """

    def __init__(self, specs: Sequence[BoundingSpec], output_names: Sequence[str]) -> None:
        super().__init__()
        names = list(output_names)
        self.specs = tuple(specs)
        for i, spec in enumerate(self.specs):
            unknown = [v for v in (*spec.variables, *([spec.total_variable] if spec.total_variable else []))
                       if v not in names]
            if unknown:
                raise ValueError(f"model.bounding[{i}] (kind={spec.kind!r}) names {unknown}, which are not output "
                                 f"variables ({names}): name output variables or drop them")
            self.register_buffer(f"columns_{i}", torch.tensor([names.index(v) for v in spec.variables]),
                                 persistent=False)
            total = names.index(spec.total_variable) if spec.total_variable else -1
            self.register_buffer(f"total_{i}", torch.tensor([total]), persistent=False)
            self.register_buffer(f"thresholds_{i}", torch.tensor(spec.thresholds or (), dtype=torch.float64),
                                 persistent=False)

    def forward(self, out: Tensor) -> Tensor:
        for i, spec in enumerate(self.specs):
            columns = getattr(self, f"columns_{i}")
            thresholds = getattr(self, f"thresholds_{i}").to(out.dtype) if spec.thresholds else None
            bounded = _bound(spec, out.index_select(-1, columns), thresholds)
            if spec.total_variable is not None:  # a fraction of the (already bounded) total
                bounded = bounded * out.index_select(-1, getattr(self, f"total_{i}"))
            out = out.index_copy(-1, columns, bounded)
        return out

    def extra_repr(self) -> str:
        return ", ".join(f"{s.kind}({', '.join(s.variables)})" for s in self.specs)
