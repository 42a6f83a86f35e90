"""Eager selective checkpointing without a dispatch mode (:mod:`stormshard.kernels.kept_outputs`).

- a selective block's first eager call is watched by torch's selective checkpointing; once it showed only
  stormshard's kernels, later calls keep the kernels' outputs through the kernels themselves: no dispatch mode,
  the attention forward still once per step, the outputs and gradients of the model without checkpointing
  (float64), for the window, CSR and Triton graph kernels;
- a block running another attention operator (torch's SDPA kernel) stays with torch's modes;
- a kept output written to in place is computed afresh in the recompute; a kept output is let go of once
  taken (a retained graph's second backward computes it again); a backward on another thread replays;
  ``own_keeping=False`` always takes torch's modes.
"""

from __future__ import annotations

import functools
import importlib.util
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import stormshard.layers.checkpointing as checkpointing
from stormshard.kernels import banded
from stormshard.kernels.dispatch import sliding_window_attention
from stormshard.kernels.kept_outputs import KeptOutputs, keeping_outputs, kept_or_computed
from stormshard.layers.checkpointing import ActivationCheckpoint
from tests.test_selective_checkpointing import _model, _step, kernel_calls  # noqa: F401 - a fixture


@pytest.fixture
def watched_calls(monkeypatch) -> list[int]:
    """One entry per checkpoint call that torch's selective checkpointing watched (a dispatch mode pair made)."""
    made: list[int] = []
    original = checkpointing.create_selective_checkpoint_contexts

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        made.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(checkpointing, "create_selective_checkpoint_contexts", counted)
    monkeypatch.setattr(checkpointing, "_SELECTIVE_CONTEXTS",
                        functools.partial(counted, checkpointing.keep_attention_outputs))
    return made


@pytest.mark.parametrize("case", ["transformer", "graphtransformer", "ensemble", "gnn"])
def test_later_eager_steps_keep_kernel_outputs_without_a_dispatch_mode(case, kernel_calls,  # noqa: F811
                                                                       watched_calls):
    plain = _step(_model(case, False), case, kernel_calls)
    model = _model(case, "selective")
    wrappers = [m for m in model.modules() if isinstance(m, ActivationCheckpoint)]
    assert len(wrappers) == 2 and not any(w.keeps_own_outputs() for w in wrappers)
    for step in range(3):
        watched_calls.clear()
        out, grads, attention_calls = _step(model, case, kernel_calls)
        assert len(watched_calls) == (2 if step == 0 else 0)  # the first step watched each block, later none
        assert all(w.keeps_own_outputs() for w in wrappers)
        assert attention_calls == plain[2]  # no attention forward in any recompute
        torch.testing.assert_close(out, plain[0], rtol=1e-13, atol=1e-13)
        for name, grad in plain[1].items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-12, atol=1e-13, msg=lambda m, n=name: f"{n}: {m}")


class _SdpaBlock(nn.Module):
    """A user's block around torch's SDPA (a fused kernel selective checkpointing keeps, not stormshard's)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).view(1, x.shape[0], 3, 2, 4).permute(2, 0, 3, 1, 4)
        return x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(x.shape)


def test_a_block_with_another_attention_operator_stays_with_torchs_modes(watched_calls):
    torch.manual_seed(0)
    block = _SdpaBlock()
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    reference = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    wrapped = ActivationCheckpoint(block, "selective")
    for _ in range(2):
        grads = torch.autograd.grad(wrapped(x).square().sum(), [x, *block.parameters()])
        for a, b in zip(grads, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    assert not wrapped.keeps_own_outputs()
    assert len(watched_calls) == 2  # every call watched


class _WindowBlock(nn.Module):
    """``lin(x) -> banded window attention -> (in place: out * 2 when asked) -> proj``; ``x`` ``(1, 1, seq, 4)``."""

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 12, dtype=torch.float64)
        self.proj = nn.Linear(4, 4, dtype=torch.float64)
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.lin(x).chunk(3, dim=-1)
        out = sliding_window_attention(q.contiguous(), k.contiguous(), v.contiguous(), 5, kernel="banded")
        if self.in_place:
            out.mul_(2.0)  # writes the kernel's output (a checkpointed block may: the recompute makes it again)
        return self.proj(out)


def _grads(module: nn.Module, x: torch.Tensor, *, twice: bool = False) -> list[tuple[torch.Tensor, ...]]:
    loss = module(x).square().sum()
    inputs = [x, *module.parameters()]
    runs = [torch.autograd.grad(loss, inputs, retain_graph=twice)]
    if twice:
        runs.append(torch.autograd.grad(loss, inputs))
    return runs


class _Kept(nn.Module):
    """``block`` checkpointed with the kernels keeping their outputs (the context an eager selective block uses
    after its first call), without the watched first call: torch's selective checkpointing refuses a block that
    writes to a kept output (its first call raises), the kernels' own keeping computes such an output afresh."""

    def __init__(self, block: nn.Module) -> None:
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.block, x, use_reentrant=False, context_fn=keeping_outputs)


@pytest.mark.parametrize("in_place", [False, True])
def test_replay_checks_versions_and_lets_go_of_what_it_replayed(in_place, monkeypatch):
    torch.manual_seed(0)
    block = _WindowBlock(in_place)
    x = torch.randn(1, 1, 11, 4, dtype=torch.float64, requires_grad=True)
    reference = _grads(ActivationCheckpoint(block, "full"), x)[0]
    forwards = []
    monkeypatch.setattr(banded, "_banded_forward", lambda *a: forwards.append(1) or banded_forward(*a))
    for grads in _grads(_Kept(block), x, twice=True):
        for a, b in zip(grads, reference[:1] + reference[1:], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
    # kept: the first backward takes the forward's outputs, the second (the store let go of them) computes them;
    # written in place: both recomputes compute them afresh
    assert len(forwards) == (3 if in_place else 2)
    if not in_place:
        wrapped = ActivationCheckpoint(block, "selective")
        _grads(wrapped, x)
        assert wrapped.keeps_own_outputs()


banded_forward = banded._banded_forward


def test_own_keeping_off_always_watches(watched_calls):
    torch.manual_seed(0)
    wrapped = ActivationCheckpoint(_WindowBlock(False), "selective", own_keeping=False)
    x = torch.randn(1, 1, 11, 4, dtype=torch.float64, requires_grad=True)
    for _ in range(3):
        _grads(wrapped, x)
    assert len(watched_calls) == 3 and not wrapped.keeps_own_outputs()


def test_the_store_replays_in_order_and_computes_what_does_not_match():
    store = KeptOutputs()
    a, b = torch.ones(3), torch.zeros(2)
    with store.recording():
        first = kept_or_computed(lambda: (a + 1,), a)
        kept_or_computed(lambda: (b + 1, b + 2), b)
    assert kept_or_computed(lambda: (a * 5,), a)[0].tolist() == [5.0] * 3  # no store active: computed
    with store.replaying():
        replayed = kept_or_computed(lambda: (a * 0,), a)
        assert replayed[0].tolist() == [2.0] * 3 and replayed[0].data_ptr() == first[0].data_ptr()
        assert store.entries[0] is None  # let go of once taken
        assert kept_or_computed(lambda: (a * 0,), a)[0].tolist() == [0.0] * 3  # other shapes than recorded
        assert kept_or_computed(lambda: (b * 0,), b)[0].tolist() == [0.0] * 2  # past the recorded calls


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install triton)")
def test_the_triton_graph_kernel_keeps_its_outputs(monkeypatch):
    from stormshard.kernels import graph_triton

    class GraphBlock(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(16, 48)
            self.edge = nn.Linear(3, 16)

        def forward(self, x: torch.Tensor, attr: torch.Tensor) -> torch.Tensor:
            q, k, v = self.lin(x).view(x.shape[0], 3, 2, 8).unbind(1)
            out = graph_triton.triton_graph_attention(q, k, v, attr, self.edge.weight, self.edge.bias, edges, 7)
            return x + out.reshape(x.shape)

    g = torch.Generator().manual_seed(0)
    edges = torch.stack([torch.randint(0, 7, (20,), generator=g), torch.randint(0, 7, (20,), generator=g)])
    torch.manual_seed(0)
    block = GraphBlock()
    x, attr = torch.randn(7, 16, generator=g, requires_grad=True), torch.randn(20, 3, generator=g)
    reference = torch.autograd.grad(block(x, attr).square().sum(), [x, *block.parameters()])
    wrapped = ActivationCheckpoint(block, "selective")
    forwards = []
    run_forward = graph_triton._run_forward
    monkeypatch.setattr(graph_triton, "_run_forward", lambda *a: forwards.append(1) or run_forward(*a))
    for _ in range(2):
        grads = torch.autograd.grad(wrapped(x, attr).square().sum(), [x, *block.parameters()])
        for a, b in zip(grads, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert wrapped.keeps_own_outputs() and len(forwards) == 2  # once per step


def test_a_backward_on_another_thread_replays(monkeypatch):
    """CUDA runs the backward (and so the recompute) on autograd's device thread, not the forward's: the store is
    found there too (here the backward runs on a thread of its own)."""
    torch.manual_seed(0)
    block = _WindowBlock(False)
    x = torch.randn(1, 1, 11, 4, dtype=torch.float64, requires_grad=True)
    reference = _grads(ActivationCheckpoint(block, "full"), x)[0]
    wrapped = ActivationCheckpoint(block, "selective")
    _grads(wrapped, x)
    forwards = []
    monkeypatch.setattr(banded, "_banded_forward", lambda *a: forwards.append(1) or banded_forward(*a))
    loss = wrapped(x).square().sum()
    grads: list[tuple[torch.Tensor, ...]] = []
    worker = threading.Thread(target=lambda: grads.append(torch.autograd.grad(loss, [x, *block.parameters()])))
    worker.start()
    worker.join()
    assert len(forwards) == 1 and wrapped.keeps_own_outputs()
    for a, b in zip(grads[0], reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-13)
