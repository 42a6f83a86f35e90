"""Measurements both sides of the GPU head-to-head take (``benchmarks/bench_gpu_vs_anemoi.py`` and
``gpu_vs_stormshard.py`` here, in anemoi's interpreter): step timing and peak memory, the GPU busy
fraction from torch.profiler, the rows, and one graph-attention block's seeded inputs and fwd + bwd timing.

**GPU busy fraction**: one step under ``torch.profiler`` (CPU + CUDA activities); the union of the
intervals of its device events (kernels, copies, memsets; sync waits left out) over the median step time of
the unprofiled steps, at most 1 (the profiler's host overhead stays out of the denominator). On a CPU the
same code returns the union of the host operators (the code path only: no GPU column).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from bench_gpu import _peak_mib, _sync, time_steps

__all__ = ["BUSY_ACTIVITIES", "union_seconds", "device_spans", "profiled_busy", "ModelRow", "finish_model_row", "model_inputs",
           "AttentionRow", "attention_graphs", "attention_inputs", "measure_attention"]

ENCODER, PROCESSOR, DECODER = ("data", "to", "hidden"), ("hidden", "to", "hidden"), ("hidden", "to", "data")


def union_seconds(spans: list[tuple[int, int]]) -> float:
    """Length of the union of ``[start, end)`` nanosecond intervals, in seconds."""
    total, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total / 1e9


#: the profiler activities that occupy the device ("cuda") or are host work ("cpu", for tests); left out:
#: user annotations mirrored onto the GPU timeline ("gpu_user_annotation": they span the idle gaps between
#: the kernels of a range such as ``Optimizer.step``), sync waits, runtime calls
BUSY_ACTIVITIES = {"cuda": frozenset({"kernel", "gpu_memcpy", "gpu_memset"}), "cpu": frozenset({"cpu_op"})}


def _fallback_kind(event, device_type: str) -> str:  # noqa: ANN001
    """The activity type of a kineto event without ``activity_type()`` (torch 2.11 has none): user annotations
    (on the host or mirrored onto the GPU) and sync waits by name; any other event is a host operator on the
    CPU and counted as a kernel on the GPU (copies and memsets are busy time too)."""
    if event.is_user_annotation() or "annotation" in event.name():
        return "user_annotation"
    if "Sync" in event.name():
        return "cuda_sync"
    return "cpu_op" if device_type == "cpu" else "kernel"


def device_spans(prof, device_type: str, kinds: Counter | None = None) -> list[tuple[int, int]]:  # noqa: ANN001
    """``(start_ns, end_ns)`` of the profiler's events of :data:`BUSY_ACTIVITIES` on ``device_type`` ("cuda":
    kernels, copies, memsets; "cpu": host operators). Where the event has no activity type (torch 2.11),
    :func:`_fallback_kind` names it. ``kinds`` counts every event on the
    device by activity type (kept or not)."""
    from torch.autograd import DeviceType

    want = DeviceType.CUDA if device_type == "cuda" else DeviceType.CPU
    keep = BUSY_ACTIVITIES[device_type]
    spans = []
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != want or e.duration_ns() <= 0:
            continue
        kind = str(e.activity_type()) if hasattr(e, "activity_type") else _fallback_kind(e, device_type)
        if kinds is not None:
            kinds[kind] += 1
        if kind not in keep:
            continue
        spans.append((e.start_ns(), e.start_ns() + e.duration_ns()))
    return spans


def profiled_busy(step: Callable[[], object], device: torch.device) -> tuple[float, int, float, dict[str, int]]:
    """One ``step`` under torch.profiler: (seconds some busy event ran, busy events, profiled wall s, every
    device event counted by activity type). On a CPU the host operators' union (the code path; no GPU column)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    _sync(device)
    with profile(activities=activities) as prof:
        tic = time.perf_counter()
        step()
        _sync(device)
        wall = time.perf_counter() - tic
    kinds: Counter = Counter()
    spans = device_spans(prof, device.type, kinds)
    return union_seconds(spans), len(spans), wall, dict(kinds)


@dataclass
class ModelRow:
    """One whole-model row; ``impl``: "stormshard eager" / "stormshard compiled" / "anemoi"."""

    size: str
    impl: str
    step_ms: float = math.nan
    peak_gib: float = math.nan
    busy: float = math.nan
    tflops: float = math.nan
    mfu: float = math.nan
    compile_s: float = math.nan
    loss: float = math.nan
    note: str = ""
    extra: dict = field(default_factory=dict)


def finish_model_row(row: ModelRow, step: Callable[[], float], device: torch.device, warmup: int, steps: int,
                     flops: float, peak: float | None) -> None:
    """Time ``step`` (:func:`bench_gpu.time_steps`), profile one more, fill ``row``."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first, median, loss = time_steps(step, device, warmup, steps)
    row.peak_gib = _peak_mib(device) / 1024
    busy_s, events, wall, kinds = profiled_busy(step, device)
    row.step_ms, row.loss, row.compile_s = median * 1e3, loss, first - median
    row.busy = min(1.0, busy_s / median) if device.type == "cuda" and events else math.nan  # none seen: unknown
    row.tflops = flops / median / 1e12
    row.mfu = flops / median / peak if peak else math.nan
    row.extra.update(busy_ms=busy_s * 1e3, device_events=events, profiled_step_ms=wall * 1e3, activities=kinds)


def model_inputs(graph, variables, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """The normalised input ``(1, 2, N_d, n_in)`` and target ``(1, N_d, n_out)`` both sides use (seeded)."""
    gen = torch.Generator().manual_seed(1)
    cells = graph["data"].num_nodes
    x = torch.randn(1, 2, cells, len(variables.input_names), generator=gen)
    target = torch.randn(1, cells, len(variables.output_names), generator=gen)
    return x.to(device), target.to(device)


@dataclass
class AttentionRow:
    """One graph-attention row: ``impl`` "stormshard triton" / "stormshard csr" / "anemoi triton"."""

    graph: str
    impl: str
    edges: int = 0
    fwd_ms: float = math.nan
    bwd_ms: float = math.nan
    peak_mib: float = math.nan
    note: str = ""
    # <out, grad>, <dq, q>, <dk, k>, <dv, v>, <dW, W> of the last step (float64): the same seeded inputs on
    # both sides, so equal values say both libraries computed the same function and gradients
    probes: list[float] = field(default_factory=list)

    @property
    def total_ms(self) -> float:
        return self.fwd_ms + self.bwd_ms


def attention_graphs(graph) -> list[tuple[str, torch.Tensor, int, int]]:  # noqa: ANN001
    """``(name, edge_index (2, E) destination-sorted, num_src, num_dst)`` of the encoder, processor, decoder."""
    n_d, n_h = graph["data"].num_nodes, graph["hidden"].num_nodes
    return [("encoder", graph[ENCODER].edge_index, n_d, n_h), ("processor", graph[PROCESSOR].edge_index, n_h, n_h),
            ("decoder", graph[DECODER].edge_index, n_h, n_d)]


def attention_inputs(num_src: int, num_dst: int, edges: int, channels: int, heads: int, features: int,
                     device: torch.device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Seeded inputs of one block's attention (both sides draw the same): q / k / v ``(nodes, heads, d)`` in
    ``dtype``, fp32 ``attr`` ``(E, F)``, ``weight`` ``(C, F)``, ``bias`` ``(C,)``, output gradient ``grad``."""
    gen = torch.Generator(device=device).manual_seed(7)
    d = channels // heads

    def randn(*shape: int, dt: torch.dtype = torch.float32, grad: bool = True) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device).to(dt).requires_grad_(grad)

    return {"q": randn(num_dst, heads, d, dt=dtype), "k": randn(num_src, heads, d, dt=dtype),
            "v": randn(num_src, heads, d, dt=dtype), "attr": randn(edges, features, grad=False),
            "weight": randn(channels, features), "bias": randn(channels),
            "grad": randn(num_dst, heads, d, dt=dtype, grad=False)}


def measure_attention(row: AttentionRow, forward: Callable[[], torch.Tensor], inputs: dict[str, torch.Tensor],
                      device: torch.device, warmup: int, steps: int) -> None:
    """Fill ``row``: median forward and backward ms of ``forward().backward(grad)``, the peak MiB above the
    memory held before (the inputs), and the last step's :attr:`AttentionRow.probes`."""
    leaves = [t for t in inputs.values() if t.requires_grad]
    base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    fwd, bwd = [], []
    for i in range(warmup + steps):
        for t in leaves:
            t.grad = None
        _sync(device)
        tic = time.perf_counter()
        out = forward()
        _sync(device)
        mid = time.perf_counter()
        out.backward(inputs["grad"])
        _sync(device)
        if i >= warmup:
            fwd.append(mid - tic)
            bwd.append(time.perf_counter() - mid)
        if i < warmup + steps - 1:
            del out
    row.peak_mib = (_peak_mib(device) - base / 2**20) if device.type == "cuda" else math.nan
    row.fwd_ms, row.bwd_ms = statistics.median(fwd) * 1e3, statistics.median(bwd) * 1e3

    def dot(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() * b.double()).sum())

    row.probes = [dot(out.detach(), inputs["grad"])] + [
        dot(inputs[k].grad, inputs[k].detach()) if inputs[k].grad is not None else math.nan for k in ("q", "k", "v", "weight")]
