"""Time and count the dense matrix products of a piece of code: the floor under a CPU step.

On a CPU at one thread per rank the dense matrix products (``mm``, ``addmm``, ``bmm``, ``baddbmm``
and their in-place and ``out=`` forms, forward and backward) of a layer run at the core's peak and
cannot get faster; two implementations with the same parameters do the same dense FLOPs. Their
time is the floor of the step: an implementation that spent nothing on anything else (attention,
norms, activations, communication) would still take it. ``anemoi time / this floor`` is then the
largest speed-up any implementation of the same dense math could show on this machine.

:class:`DenseGemmTimer` is a ``TorchDispatchMode`` that times every dense product of the code it
wraps (``time.perf_counter`` around the op: CPU, synchronous) and adds up ``2 * M * K * N`` per
product. Sparse operands (CSR products of a graph kernel) are not counted: they are not dense work.
Depends on torch only, so that anemoi's interpreter can load it too
(``benchmarks/anemoi_side/gemm_floor.py``).
"""

from __future__ import annotations

import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["DenseGemmTimer", "peak_gemm_rate"]

_aten = torch.ops.aten
_PRODUCTS = {_aten.mm, _aten.addmm, _aten.addmm_, _aten.bmm, _aten.baddbmm, _aten.baddbmm_}
_WITH_INPUT = {_aten.addmm, _aten.addmm_, _aten.baddbmm, _aten.baddbmm_}  # (input, mat1, mat2, ...)


def _flops(packet, args: tuple) -> int:  # noqa: ANN001
    a, b = args[1:3] if packet in _WITH_INPUT else args[:2]
    batch = a.shape[0] if a.dim() == 3 else 1
    return 2 * batch * a.shape[-2] * a.shape[-1] * b.shape[-1]


class DenseGemmTimer(TorchDispatchMode):
    """``with DenseGemmTimer() as t: step()`` -> ``t.seconds``, ``t.flops``, ``t.calls`` of the dense products."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds, self.flops, self.calls = 0.0, 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        packet = func.overloadpacket
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if packet not in _PRODUCTS or any(t.layout != torch.strided for t in tensors):
            return func(*args, **kwargs)
        t0 = time.perf_counter()
        out = func(*args, **kwargs)
        self.seconds += time.perf_counter() - t0
        self.flops += _flops(packet, args)
        self.calls += 1
        return out

    @property
    def gflops_per_s(self) -> float:
        return self.flops / self.seconds / 1e9 if self.seconds else 0.0


def peak_gemm_rate(rows: int = 2048, channels: int = 256, hidden: int = 1024, seconds: float = 1.0) -> float:
    """GFLOP/s of a linear layer's three products (forward, input and weight gradients) on
    ``(rows, channels) -> (rows, hidden)`` float32 operands, repeated for about ``seconds`` in this
    process (its threads): the rate the dense products of the benchmarked layers can reach at best."""
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, channels, generator=gen), torch.randn(hidden, channels, generator=gen)
    b, g = torch.randn(hidden, generator=gen), torch.randn(rows, hidden, generator=gen)

    def layer() -> None:
        torch.addmm(b, x, w.t())
        g.t() @ x
        g @ w

    for _ in range(3):
        layer()
    count, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        layer()
        count += 1
    return 3 * 2 * rows * channels * hidden * count / (time.perf_counter() - t0) / 1e9
