"""Normalisation from a dataset's stored statistics, as torch buffers.

Per variable, ``normalise(x) = (x - offset) / scale`` with

- ``"mean-std"``: offset = mean, scale = stdev;
- ``"std"``: offset = 0, scale = stdev;
- ``"min-max"``: offset = minimum, scale = maximum - minimum (values land in [0, 1]);
- ``"max"``: offset = 0, scale = maximum;
- ``"none"``: offset = 0, scale = 1.

(anemoi-training's method names.)

``denormalise`` is the exact inverse. Tensors are ``(..., variables)`` with the variables in the
normaliser's own order (e.g. the model's input or output variables, a subset of the dataset's).
The buffers follow ``.to(device)`` and are saved with the model's state dict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from stormshard.data.anemoi_layout import Statistics

__all__ = ["METHODS", "FILL_METHODS", "Normaliser", "nan_fill_values"]

METHODS = ("mean-std", "std", "min-max", "max", "none")


class Normaliser(nn.Module):
    """Per-variable affine normalisation ``(x - offset) / scale`` over the last dim of ``(..., variables)``.

    Buffers: ``offset`` and ``scale``, float64 ``(variables,)`` (cast to the input's dtype on use).
    """

    def __init__(self, variables: Sequence[str], offset: np.ndarray | Tensor, scale: np.ndarray | Tensor) -> None:
        super().__init__()
        self.variables = [str(v) for v in variables]
        offset = torch.as_tensor(np.asarray(offset, dtype=np.float64))
        scale = torch.as_tensor(np.asarray(scale, dtype=np.float64))
        n = len(self.variables)
        if offset.shape != (n,) or scale.shape != (n,):
            raise ValueError(f"offset {tuple(offset.shape)} and scale {tuple(scale.shape)} must both be ({n},), "
                             f"one value per variable of {self.variables}")
        bad = [v for v, s in zip(self.variables, scale.tolist(), strict=True) if not np.isfinite(s) or s <= 0]
        if bad:
            raise ValueError(f"variables {bad} have a zero, negative or non-finite scale: choose the method 'none' "
                             "for them (e.g. a constant field) or fix the statistics")
        self.register_buffer("offset", offset)
        self.register_buffer("scale", scale)

    @classmethod
    def from_statistics(
        cls,
        statistics: Statistics,
        dataset_variables: Sequence[str],
        variables: Sequence[str] | None = None,
        methods: Mapping[str, str] | None = None,
        default: str = "mean-std",
    ) -> Normaliser:
        """Normaliser for ``variables`` (default: all of ``dataset_variables``, in that order).

        ``methods`` maps a variable name to one of :data:`METHODS`; the others use ``default``.
        """
        dataset_variables = list(dataset_variables)
        if len(statistics) != len(dataset_variables):
            raise ValueError(f"statistics have {len(statistics)} values but dataset_variables lists "
                             f"{len(dataset_variables)} names")
        variables = dataset_variables if variables is None else list(variables)
        methods = dict(methods or {})
        index = {v: i for i, v in enumerate(dataset_variables)}
        for name in [*variables, *methods]:
            if name not in index:
                raise ValueError(f"variable {name!r} is not in the dataset (it has {dataset_variables})")
        for name, method in [*methods.items(), ("default", default)]:
            if method not in METHODS:
                raise ValueError(f"normalisation method {method!r} for {name} is unknown: use one of {METHODS}")
        offset, scale = np.zeros(len(variables)), np.ones(len(variables))
        for j, name in enumerate(variables):
            i, method = index[name], methods.get(name, default)
            if method == "mean-std":
                offset[j], scale[j] = statistics.mean[i], statistics.stdev[i]
            elif method == "std":
                scale[j] = statistics.stdev[i]
            elif method == "min-max":
                offset[j], scale[j] = statistics.minimum[i], statistics.maximum[i] - statistics.minimum[i]
            elif method == "max":
                scale[j] = statistics.maximum[i]
        return cls(variables, offset, scale)

    def _check(self, x: Tensor) -> None:
        if x.shape[-1] != len(self.variables):
            raise ValueError(f"the last dim of x has {x.shape[-1]} entries but the normaliser has "
                             f"{len(self.variables)} variables {self.variables}")

    def normalise(self, x: Tensor) -> Tensor:
        """``(x - offset) / scale`` for ``x`` ``(..., variables)``; returns a new tensor of x's dtype."""
        self._check(x)
        return (x - self.offset.to(x.dtype)) / self.scale.to(x.dtype)

    def denormalise(self, x: Tensor) -> Tensor:
        """``x * scale + offset``: the inverse of :meth:`normalise`."""
        self._check(x)
        return x * self.scale.to(x.dtype) + self.offset.to(x.dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.normalise(x)

    def extra_repr(self) -> str:
        return f"variables={self.variables}"


FILL_METHODS = ("mean", "minimum", "maximum")


def nan_fill_values(statistics: Statistics, dataset_variables: Sequence[str], normaliser: Normaliser,
                    fills: Mapping[str, str | float] | None = None, default: str | float = "mean") -> Tensor:
    """``(variables,)`` float64: the normalised value that replaces a NaN input of each of the
    normaliser's variables (missing data, e.g. sea-surface temperature over land).

    ``fills`` maps a variable name to ``"mean"``, ``"minimum"``, ``"maximum"`` (the dataset
    statistic) or a number in physical units; the others use ``default`` ("mean": 0 after
    mean-std normalisation, the anemoi imputer's default). The value is normalised with the
    normaliser's own offset and scale.
    """
    fills = dict(fills or {})
    index = {v: i for i, v in enumerate(dataset_variables)}
    unknown = sorted(set(fills) - set(normaliser.variables))
    if unknown:
        raise ValueError(f"data.imputation names {unknown}, which are not model input variables "
                         f"({normaliser.variables}): fix the names or remove them")
    values = torch.empty(len(normaliser.variables), dtype=torch.float64)
    for j, name in enumerate(normaliser.variables):
        how = fills.get(name, default)
        if isinstance(how, str):
            if how not in FILL_METHODS:
                raise ValueError(f"data.imputation for {name} is {how!r}: use one of {FILL_METHODS} or a number "
                                 "(physical units)")
            value = float(getattr(statistics, how)[index[name]])
        else:
            value = float(how)
            if not np.isfinite(value):
                raise ValueError(f"data.imputation for {name} is {how!r}: give a finite number")
        values[j] = (value - float(normaliser.offset[j])) / float(normaliser.scale[j])
    return values
