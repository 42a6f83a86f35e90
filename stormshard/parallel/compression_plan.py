"""PowerSGD's settings and plan: which gradients are compressed, and where their factors live.

:class:`PowerSGDConfig` is the one PowerSGD schema (an experiment config's ``compression``
section). :func:`make_plan` turns the parameter names and shapes and a config into a
:class:`CompressionPlan`, computed once: every gradient ``G`` with at least two dimensions is a
matrix ``(rows, cols) = (shape[0], prod(shape[1:]))``; those large and compressible enough get a
rank-``r`` factor pair, P ``(rows, r)`` and Q stored transposed ``(r, cols)``, laid out in two flat
buffers grouped by shape (:class:`FactorGroup`), and an error-feedback buffer ``(rows, cols)``.
:class:`StepBytes` reports what a step sends. The compressor that runs the plan is
:class:`stormshard.parallel.compression.PowerSGDCompressor`. Nothing here communicates.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any

from einops import rearrange

if TYPE_CHECKING:  # torch-free at import: the experiment config reads PowerSGDConfig before torch loads
    from torch import Tensor

__all__ = ["PowerSGDConfig", "MatrixEntry", "FactorGroup", "CompressionPlan", "make_plan", "StepBytes"]


# --------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PowerSGDConfig:
    """Settings of :class:`PowerSGDCompressor`; validated on construction (a wrong type is a
    ``TypeError``, a bad value a ``ValueError``, each naming the field).

    The one PowerSGD schema: an experiment config's ``compression`` section,
    ``{"type": "powersgd", <these fields>}``, is parsed into this class and handed to the engines as is.

    - ``rank``: rank ``r`` of the approximation ``P Q^T`` (capped at ``min(rows, cols)``);
    - ``start_iter``: steps ``0 .. start_iter - 1`` use exact all-reduce (0: compress from the start);
    - ``min_compression_rate``: compress a matrix only if ``rows*cols >= rate * (rows+cols) * r``;
    - ``min_numel``: tensors with fewer elements are reduced exactly;
    - ``warm_start``: reuse last step's Q (else a fresh random Q every step);
    - ``use_error_feedback``: carry ``M - P Q^T`` into the next step;
    - ``orthogonalisation_eps``: a column of P with norm below this is divided by it instead;
    - ``seed``: seed of the random Q columns (the same on every rank);
    - ``overlap``: all-reduce the uncompressed bucket asynchronously while P and Q are computed.
    """

    rank: int = 4
    start_iter: int = 10
    min_compression_rate: float = 2.0
    min_numel: int = 4096
    warm_start: bool = True
    use_error_feedback: bool = True
    orthogonalisation_eps: float = 1e-8
    seed: int = 0
    overlap: bool = True

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int)):
                raise TypeError(f"PowerSGDConfig.{f.name} must be an int, got {value!r} ({type(value).__name__})")
            if f.type in ("bool", bool) and not isinstance(value, bool):
                raise TypeError(f"PowerSGDConfig.{f.name} must be a bool, got {value!r} ({type(value).__name__})")
            if f.type in ("float", float) and (isinstance(value, bool) or not isinstance(value, (int, float))):
                raise TypeError(f"PowerSGDConfig.{f.name} must be a number, got {value!r} ({type(value).__name__})")
        if self.rank < 1:
            raise ValueError(f"PowerSGDConfig.rank must be at least 1, got {self.rank}: use e.g. rank=4")
        if self.start_iter < 0:
            raise ValueError(
                f"PowerSGDConfig.start_iter must be >= 0, got {self.start_iter}: "
                "use 0 to compress from the first step"
            )
        if not math.isfinite(self.min_compression_rate) or self.min_compression_rate < 0:
            raise ValueError(
                f"PowerSGDConfig.min_compression_rate must be a finite number >= 0, got {self.min_compression_rate}: "
                "use e.g. 2.0 (compress only matrices whose factors are at most half their size)"
            )
        if self.min_numel < 0:
            raise ValueError(f"PowerSGDConfig.min_numel must be >= 0, got {self.min_numel}: use e.g. 4096")
        eps = self.orthogonalisation_eps
        if not math.isfinite(eps) or eps <= 0:
            raise ValueError(
                f"PowerSGDConfig.orthogonalisation_eps must be a finite number > 0, got {eps}: use e.g. 1e-8"
            )
        if self.seed < 0:
            raise ValueError(f"PowerSGDConfig.seed must be >= 0, got {self.seed}")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# --------------------------------------------------------------------------------------------
# plan: which tensors are compressed and where their factors live in the flat buffers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MatrixEntry:
    """One parameter in the plan. ``p_offset``/``q_offset``/``e_offset`` are -1 when uncompressed."""

    index: int
    name: str
    shape: tuple[int, ...]
    numel: int
    compressed: bool
    rows: int
    cols: int
    rank: int
    p_offset: int = -1
    q_offset: int = -1
    e_offset: int = -1


@dataclass(frozen=True)
class FactorGroup:
    """``count`` consecutive factors of equal shape starting at ``offset`` in a flat buffer: P factors
    are ``(length, rank)`` (``length = rows``), Q factors ``(rank, length)`` (``length = cols``)."""

    offset: int
    count: int
    length: int
    rank: int

    def view(self, flat: Tensor) -> Tensor:
        """``(count, length, rank)`` view of a P group in ``flat``."""
        n = self.count * self.length * self.rank
        return rearrange(flat[self.offset : self.offset + n], "(k l r) -> k l r", k=self.count, l=self.length)

    def view_t(self, flat: Tensor) -> Tensor:
        """``(count, rank, length)`` view of a Q group in ``flat``."""
        n = self.count * self.length * self.rank
        return rearrange(flat[self.offset : self.offset + n], "(k r l) -> k r l", k=self.count, l=self.length)


@dataclass(frozen=True)
class CompressionPlan:
    """Computed once from the parameter shapes and the config.

    P factors ``(rows, r)`` are stored grouped by shape (so equal shapes are orthonormalised in one
    batched call), Q factors are stored transposed, ``(r, cols)``, grouped by shape; the error
    buffer ``(rows, cols)`` per matrix follows parameter order.
    """

    entries: tuple[MatrixEntry, ...]
    p_groups: tuple[FactorGroup, ...]
    q_groups: tuple[FactorGroup, ...]
    p_numel: int
    q_numel: int
    error_numel: int

    @property
    def compressed(self) -> tuple[MatrixEntry, ...]:
        return tuple(e for e in self.entries if e.compressed)

    @property
    def uncompressed(self) -> tuple[MatrixEntry, ...]:
        return tuple(e for e in self.entries if not e.compressed)

    @property
    def exact_numel(self) -> int:
        """Elements all-reduced exactly after ``start_iter``."""
        return sum(e.numel for e in self.uncompressed)

    @property
    def total_numel(self) -> int:
        return sum(e.numel for e in self.entries)


def _grouped_offsets(entries: Sequence[MatrixEntry], key: str) -> tuple[dict[int, int], tuple[FactorGroup, ...], int]:
    """Offsets of each entry's ``(length, r)`` factor, ordered so that equal shapes are adjacent."""
    order = sorted(entries, key=lambda e: (getattr(e, key), e.rank, e.index))
    offsets: dict[int, int] = {}
    groups: list[FactorGroup] = []
    offset = 0
    for e in order:
        length = getattr(e, key)
        last = groups[-1] if groups else None
        if last is not None and (last.length, last.rank) == (length, e.rank):
            groups[-1] = FactorGroup(last.offset, last.count + 1, length, e.rank)
        else:
            groups.append(FactorGroup(offset, 1, length, e.rank))
        offsets[e.index] = offset
        offset += length * e.rank
    return offsets, tuple(groups), offset


def make_plan(names: Sequence[str], shapes: Sequence[tuple[int, ...]], config: PowerSGDConfig) -> CompressionPlan:
    """Decide for each tensor whether it is compressed, and lay out the factor buffers."""
    raw: list[MatrixEntry] = []
    for i, (name, shape) in enumerate(zip(names, shapes, strict=True)):
        numel = math.prod(shape)
        rows = shape[0] if len(shape) >= 2 else numel
        cols = numel // rows if len(shape) >= 2 and rows > 0 else 1
        r = max(1, min(config.rank, rows, cols))
        worth = rows * cols >= config.min_compression_rate * (rows + cols) * r
        compressed = len(shape) >= 2 and numel > 0 and numel >= config.min_numel and worth
        raw.append(MatrixEntry(i, name, tuple(shape), numel, compressed, rows, cols, r))
    comp = [e for e in raw if e.compressed]
    p_off, p_groups, p_numel = _grouped_offsets(comp, "rows")
    q_off, q_groups, q_numel = _grouped_offsets(comp, "cols")
    entries, e_offset = [], 0
    for e in raw:
        if e.compressed:
            e = MatrixEntry(**{**asdict(e), "shape": e.shape, "p_offset": p_off[e.index],
                               "q_offset": q_off[e.index], "e_offset": e_offset})
            e_offset += e.numel
        entries.append(e)
    return CompressionPlan(tuple(entries), p_groups, q_groups, p_numel, q_numel, e_offset)


@dataclass(frozen=True)
class StepBytes:
    """Bytes one rank sends per step (ring all-reduce: ``2 (w-1)/w`` of each buffer) and the calls."""

    compressed: int
    exact: int
    compressed_calls: int
    exact_calls: int

    @property
    def ratio(self) -> float:
        """How many times fewer bytes PowerSGD sends than exact all-reduce."""
        return self.exact / self.compressed if self.compressed else math.inf
