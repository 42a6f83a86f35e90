"""The dense-product timer of the anemoi comparison (benchmarks/gemm_timer.py) counts what it claims.

Its FLOP count is the floor the benchmark reports, so it is checked here on products with known
counts: a linear layer's forward and backward (three products), ``out=`` and in-place forms,
batched products, and sparse products (not counted).
"""

from __future__ import annotations

import importlib.util
import pathlib
import warnings

import torch

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "gemm_timer.py"
_spec = importlib.util.spec_from_file_location("gemm_timer", _PATH)
gemm_timer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gemm_timer)


def test_linear_forward_and_backward_are_three_products():
    m, k, n = 7, 5, 3
    lin = torch.nn.Linear(k, n)
    x = torch.randn(m, k, requires_grad=True)
    with gemm_timer.DenseGemmTimer() as t:
        lin(x).sum().backward()
    assert t.calls == 3
    assert t.flops == 3 * 2 * m * k * n
    assert t.seconds > 0


def test_out_inplace_and_batched_forms_are_counted():
    a, b, c = torch.randn(4, 6), torch.randn(6, 2), torch.randn(4, 2)
    out = torch.empty(4, 2)
    with gemm_timer.DenseGemmTimer() as t:
        torch.mm(a, b, out=out)
        c.addmm_(a, b)
        torch.bmm(torch.randn(3, 4, 6), torch.randn(3, 6, 2))
        torch.baddbmm(torch.randn(3, 4, 2), torch.randn(3, 4, 6), torch.randn(3, 6, 2))
    assert t.calls == 4
    assert t.flops == 2 * (2 * 4 * 6 * 2) + 2 * (3 * 2 * 4 * 6 * 2)


def test_sparse_products_and_other_ops_are_not_counted():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        sparse = torch.eye(5).to_sparse_csr()
    dense = torch.randn(5, 3)
    with gemm_timer.DenseGemmTimer() as t:
        sparse @ dense
        (dense * 2).sum()
    assert t.calls == 0 and t.flops == 0 and t.seconds == 0.0
