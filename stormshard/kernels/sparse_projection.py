"""A fixed sparse linear map of node rows: ``A @ x`` for a weight matrix ``A`` ``(rows, cols)`` given by its
non-zero entries and ``x`` ``(cols, d)``, with its backward ``A^T @ grad``.

The truncated residual's two projections (data -> truncation grid -> data) are such maps. ``A`` and ``A^T`` are
CSR matrices built once from the entries (:func:`csr_pair`; int32 indices where the sizes allow), so neither the
forward nor the backward sorts, scatters or forms an ``(entries, d)`` tensor: each is one sparse-dense product
(MKL on a CPU, cuSPARSE's SpMM on CUDA). Runs with autocast off, in ``x``'s dtype (the residual it serves is
carried in fp32, never rounded to bf16). Nothing here communicates.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from stormshard.kernels.graph_csr import csr_index, csr_matrix, spmm

__all__ = ["CsrPair", "csr_pair", "sparse_project"]


class CsrPair(NamedTuple):
    """``A`` ``(num_rows, num_cols)`` and ``A^T`` in CSR form: row pointers, column ids and values of each."""

    crow: Tensor
    col: Tensor
    values: Tensor
    crow_t: Tensor
    col_t: Tensor
    values_t: Tensor


def _csr_of(rows: Tensor, cols: Tensor, weights: Tensor, num_rows: int, size: int) -> tuple[Tensor, Tensor, Tensor]:
    """Row pointers, column ids and values of the entries ``(rows, cols, weights)`` in CSR order."""
    order = torch.argsort(rows * max(size, 1) + cols, stable=True)
    counts = torch.bincount(rows, minlength=num_rows)
    crow = torch.zeros(num_rows + 1, dtype=torch.long)
    crow[1:] = torch.cumsum(counts, 0)
    nnz = int(rows.numel())
    return csr_index(crow, nnz, size), csr_index(cols[order], nnz, size), weights[order]


def csr_pair(rows: Tensor, cols: Tensor, weights: Tensor, shape: tuple[int, int]) -> CsrPair:
    """The CSR form of ``A`` (``A[rows[i], cols[i]] = weights[i]``, shape ``shape``; an entry given twice is
    summed) and of ``A^T``. Built once, on the entries' device (a CPU at model construction)."""
    num_rows, num_cols = shape
    rows, cols = rows.long().reshape(-1), cols.long().reshape(-1)
    weights = weights.reshape(-1)
    if not (rows.numel() == cols.numel() == weights.numel()):
        raise ValueError(f"sparse projection entries differ in length: {rows.numel()} rows, {cols.numel()} columns, "
                         f"{weights.numel()} weights")
    if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= num_rows
                         or int(cols.min()) < 0 or int(cols.max()) >= num_cols):
        raise ValueError(f"sparse projection entries leave its shape {tuple(shape)}: rows in "
                         f"[{int(rows.min())}, {int(rows.max())}], columns in [{int(cols.min())}, {int(cols.max())}]")
    size = max(num_rows, num_cols)
    return CsrPair(*_csr_of(rows, cols, weights, num_rows, size), *_csr_of(cols, rows, weights, num_cols, size))


def _product(a: Tensor, x: Tensor) -> Tensor:
    """``a @ x``; zeros for a matrix without entries (a rank whose rows feed no truncation node: the library
    product writes nothing into its uninitialised output then, on some devices)."""
    if a.values().numel() == 0:  # the entry count is metadata: no device sync
        return x.new_zeros((a.shape[0], x.shape[1]))
    return spmm(a, x)


class _SparseProject(torch.autograd.Function):
    """``A @ x``; backward ``A^T @ grad`` (``A`` carries no gradient)."""

    @staticmethod
    def forward(ctx, x: Tensor, a: Tensor, a_t: Tensor) -> Tensor:  # noqa: ANN001
        ctx.a_t = a_t
        return _product(a, x)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:  # noqa: ANN001
        return _product(ctx.a_t, grad.contiguous()), None, None


def sparse_project(x: Tensor, pair: CsrPair, shape: tuple[int, int]) -> Tensor:
    """``A @ x``: ``x`` ``(num_cols, d)`` -> ``(num_rows, d)`` in ``x``'s dtype, autocast off; differentiable in
    ``x``. ``pair`` (:func:`csr_pair`) on ``x``'s device; ``shape`` = ``(num_rows, num_cols)``."""
    if x.dim() != 2 or x.shape[0] != shape[1]:
        raise ValueError(f"sparse projection of shape {tuple(shape)} got x of shape {tuple(x.shape)}; expected "
                         f"({shape[1]}, d)")
    with torch.autocast(device_type=x.device.type, enabled=False):
        a = csr_matrix(pair.crow, pair.col, pair.values.to(x.dtype), shape)
        a_t = csr_matrix(pair.crow_t, pair.col_t, pair.values_t.to(x.dtype), (shape[1], shape[0]))
        return _SparseProject.apply(x.contiguous(), a, a_t)
