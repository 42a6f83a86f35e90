"""``stormshard.layers.row_chunked_mlp``: the row-chunked MLP equals ``nn.Sequential(Linear, GELU, Linear)``
(float64, uneven chunks, batch dims, any subset of gradients; bf16 under autocast), compiled equals eager, and it
keeps one hidden activation where autograd keeps two (and makes two more in the backward)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch
from torch import nn

from stormshard.layers.row_chunked_mlp import MIN_ELEMENTS, RowChunkedMLP, row_chunked_mlp


def _pair(channels: int = 6, hidden: int = 20, out: int | None = None, dtype=torch.float64, rows: int = 7):
    """A row-chunked MLP on its chunked path at any size (``rows`` rows per chunk) and the plain
    ``nn.Sequential`` with the same weights."""
    torch.manual_seed(0)
    lean = RowChunkedMLP(channels, hidden, out, min_elements=0, chunk_elements=rows * hidden).to(dtype)
    plain = nn.Sequential(nn.Linear(channels, hidden), nn.GELU(), nn.Linear(hidden, out or channels)).to(dtype)
    plain.load_state_dict(lean.state_dict())
    return lean, plain


def _run(mlp: nn.Module, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x = x.detach().clone().requires_grad_(x.requires_grad)
    y = mlp(x)
    (y.float() * w).sum().backward()
    grads = {n.removeprefix("_orig_mod."): p.grad for n, p in mlp.named_parameters() if p.grad is not None}
    for p in mlp.parameters():
        p.grad = None
    if x.requires_grad:
        grads["x"] = x.grad
    return y.detach(), grads


@pytest.mark.parametrize("shape", [(50, 6), (23, 3, 6), (5, 6), (1, 6)])
def test_equals_the_plain_mlp_in_float64(shape):
    lean, plain = _pair()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(*shape, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(*shape, dtype=torch.float64, generator=g)
    y_lean, g_lean = _run(lean, x, w)
    y_plain, g_plain = _run(plain, x, w)
    torch.testing.assert_close(y_lean, y_plain, rtol=1e-13, atol=1e-14)
    assert g_lean.keys() == g_plain.keys() == {"0.weight", "0.bias", "2.weight", "2.bias", "x"}
    for name in g_plain:
        torch.testing.assert_close(g_lean[name], g_plain[name], rtol=1e-12, atol=1e-13, msg=name)


def test_frozen_parameters_and_inputs_without_gradients():
    lean, plain = _pair(out=4)
    for mlp in (lean, plain):
        mlp[0].weight.requires_grad_(False)
        mlp[2].bias.requires_grad_(False)
    x = torch.randn(31, 6, dtype=torch.float64)  # no gradient asked for x
    w = torch.randn(31, 4, dtype=torch.float64)
    y_lean, g_lean = _run(lean, x, w)
    y_plain, g_plain = _run(plain, x, w)
    torch.testing.assert_close(y_lean, y_plain, rtol=1e-13, atol=1e-14)
    assert g_lean.keys() == g_plain.keys() == {"0.bias", "2.weight"}
    for name in g_plain:
        torch.testing.assert_close(g_lean[name], g_plain[name], rtol=1e-12, atol=1e-13)


def test_bf16_autocast_tracks_the_plain_mlp():
    lean, plain = _pair(channels=16, hidden=64, dtype=torch.float32, rows=9)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(100, 16, generator=g, requires_grad=True)
    w = torch.randn(100, 16, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y_lean, g_lean = _run(lean, x, w)
        y_plain, g_plain = _run(plain, x, w)
    assert y_lean.dtype == y_plain.dtype == torch.bfloat16
    torch.testing.assert_close(y_lean.float(), y_plain.float(), rtol=2e-2, atol=2e-2)
    for name in g_plain:
        assert g_lean[name].dtype == g_plain[name].dtype == torch.float32  # the parameters' (and x's) dtype
        ref = g_plain[name]
        assert (g_lean[name] - ref).abs().max() <= 2e-2 * ref.abs().max(), name


def test_small_or_gradient_free_calls_are_the_plain_mlp_bit_for_bit():
    torch.manual_seed(0)
    mlp = RowChunkedMLP(8, 32)
    plain = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 8))
    plain.load_state_dict(mlp.state_dict())
    x = torch.randn(40, 8, requires_grad=True)
    assert 40 * 32 < MIN_ELEMENTS
    assert torch.equal(mlp(x), plain(x))
    assert "row_chunked" not in repr(mlp(x).grad_fn.next_functions)
    mlp.min_elements = 0  # the chunked path from now on, except without gradients
    with torch.no_grad():
        assert torch.equal(mlp(x), plain(x))
    assert "row_chunked_mlp" in repr(mlp(x).grad_fn.next_functions)


def test_compiled_equals_eager_and_keeps_what_eager_keeps():
    """Under torch.compile the forward and backward are the custom ops: the same numbers as eager, and the same
    saved tensors (x and the pre-activation), where a plain MLP keeps the GELU output too."""
    lean, plain = _pair(channels=8, hidden=64, dtype=torch.float32, rows=50)
    x = torch.randn(300, 1, 8, requires_grad=True)
    w = torch.randn(300, 1, 8)

    def saved_bytes(fn) -> tuple[int, tuple]:  # noqa: ANN001
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = _run(fn, x, w)
        return sum(sizes), out

    eager_bytes, (y_eager, g_eager) = saved_bytes(lean)
    compiled_bytes, (y_comp, g_comp) = saved_bytes(torch.compile(lean, backend="aot_eager", fullgraph=True))
    plain_bytes, _ = saved_bytes(plain)
    torch.testing.assert_close(y_comp, y_eager, rtol=1e-6, atol=1e-6)
    for name in g_eager:
        torch.testing.assert_close(g_comp[name], g_eager[name], rtol=1e-6, atol=1e-6)
    hidden = 300 * 64 * 4
    assert compiled_bytes == eager_bytes
    assert plain_bytes - eager_bytes >= hidden  # the GELU output (300 x 64 fp32) is not kept


def test_peak_memory_holds_one_hidden_activation_instead_of_three():
    """The whole forward + backward of one MLP on real tensors, every storage recorded
    (``benchmarks/memory_simulation.py``): the plain MLP peaks with three (rows, hidden) tensors alive, the
    row-chunked one with one and a few chunks (16 of them make one activation)."""
    path = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "memory_simulation.py"
    if "memory_simulation" not in sys.modules:
        sys.path.insert(0, str(path.parent))
        spec = importlib.util.spec_from_file_location("memory_simulation", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["memory_simulation"] = module
        spec.loader.exec_module(module)
    simulation = sys.modules["memory_simulation"]
    rows, hidden = 4000, 256
    lean, plain = _pair(channels=16, hidden=hidden, dtype=torch.float32, rows=250)
    x = torch.randn(rows, 16, requires_grad=True)
    peaks = {}
    for name, mlp in (("lean", lean), ("plain", plain)):
        def step(mlp=mlp) -> None:
            mlp(x).square().sum().backward()
            mlp.zero_grad(set_to_none=True)
            x.grad = None

        census = simulation.simulate_step_memory(step, list(mlp.parameters()) + [x], warmup=0).census
        peaks[name] = census.peak - census.baseline  # the step's own allocations
    activation = rows * hidden * 4
    assert peaks["plain"] >= 3 * activation
    assert peaks["lean"] <= 1.5 * activation  # h, one chunk's temporaries, y, its gradient and x's


def test_bad_rows():
    lean, _ = _pair()
    with pytest.raises(ValueError, match="rows per chunk"):
        row_chunked_mlp(torch.randn(3, 6, dtype=torch.float64), lean[0], lean[2], 0)
    with pytest.raises(ValueError, match="chunk_elements"):
        RowChunkedMLP(4, 8, chunk_elements=0)
