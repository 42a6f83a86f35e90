"""What holds the GPU memory at the peak of one training step, by the source line that allocated it.

``record_step_memory(step)`` (CUDA) runs ``step`` once under torch's allocator history
(``torch.cuda.memory._record_memory_history``, python stacks) and returns a :class:`PeakCensus`: the
bytes allocated before the step (weights, gradients kept between steps, optimizer state, cached
structures: the *baseline*), the step's peak, and the allocations alive at that peak grouped by where
they were made: the innermost stormshard frame (``stormshard/layers/mlp.py:26 forward``), else the
innermost frame of a compiled block's generated code (``compiled block``), else the innermost frame
outside torch. ``live_at_peak(trace, baseline)`` is the analysis alone, over the allocator trace's
events (``alloc`` / ``free_completed`` with ``addr``, ``size`` and ``frames``, innermost first): a pure
function, tested on CPU with made-up traces (``tests/test_memory_census.py``).

``bench_gpu_vs_anemoi.py --memory-census`` prints the census of each stormshard whole-model row (one more
step after the timed ones), so the peak-memory goal (at most 0.5x anemoi's at the AIFS size) comes with
what to cut.
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

_PACKAGE = os.sep + "stormshard" + os.sep
_TORCH = os.sep + "torch" + os.sep
COMPILED = "compiled block (inductor code)"


@dataclass
class PeakCensus:
    """``baseline`` bytes before the step, ``peak`` bytes at its peak (baseline included), and the step's
    allocations alive at the peak: ``sources`` as ``(source, bytes, count)``, largest first."""

    baseline: int
    peak: int
    sources: list[tuple[str, int, int]] = field(default_factory=list)
    events: int = 0

    def table(self, top: int = 15) -> str:
        gib = 1024 ** 3
        lines = [f"peak {self.peak / gib:.2f} GiB = before the step {self.baseline / gib:.2f} GiB (weights, "
                 f"optimizer state, caches) + the step's allocations alive at the peak "
                 f"{(self.peak - self.baseline) / gib:.2f} GiB ({self.events} allocator events); the largest:"]
        lines += [f"  {size / gib:7.3f} GiB  {count:5d} x  {source}" for source, size, count in self.sources[:top]]
        rest = self.sources[top:]
        if rest:
            lines.append(f"  {sum(s for _, s, _ in rest) / gib:7.3f} GiB  {sum(c for _, _, c in rest):5d} x  "
                         f"({len(rest)} other sources)")
        return "\n".join(lines)


def source_of(frames: Iterable[Mapping[str, object]]) -> str:
    """Where an allocation was made (``frames`` innermost first): the innermost stormshard frame, else the
    innermost frame of inductor's generated code, else the innermost frame outside torch, else ``torch``."""
    frames = list(frames)

    def label(f: Mapping[str, object]) -> str:
        name = str(f.get("filename", ""))
        short = name[name.rindex(_PACKAGE) + 1:] if _PACKAGE in name else os.path.basename(name)
        return f"{short}:{f.get('line', '?')} {f.get('name', '?')}"

    for f in frames:
        if _PACKAGE in str(f.get("filename", "")):
            return label(f)
    for f in frames:
        name = str(f.get("filename", ""))
        if "torchinductor" in name or "inductor" in os.path.basename(os.path.dirname(name)):
            return COMPILED
    for f in frames:
        name = str(f.get("filename", ""))
        if name and _TORCH not in name and not name.startswith("??"):
            return label(f)
    return "torch"


def live_at_peak(trace: Iterable[Mapping[str, object]], baseline: int = 0) -> PeakCensus:
    """The census of an allocator trace: replays ``alloc`` (+size) and ``free_completed`` (-size) from
    ``baseline`` bytes, finds the peak, and groups the allocations alive there by :func:`source_of`. A free
    of an address allocated before the trace began lowers the running total (it was part of the baseline)."""
    live: dict[int, tuple[int, str]] = {}
    current = peak = baseline
    at_peak: dict[int, tuple[int, str]] = {}
    events = 0
    for event in trace:
        action = event.get("action")
        if action == "alloc":
            events += 1
            addr, size = int(event["addr"]), int(event["size"])
            live[addr] = (size, source_of(event.get("frames", [])))
            current += size
            if current > peak:
                peak, at_peak = current, dict(live)
        elif action == "free_completed":
            events += 1
            addr, size = int(event["addr"]), int(event["size"])
            live.pop(addr, None)
            current -= size
    grouped: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for size, source in at_peak.values():
        grouped[source][0] += size
        grouped[source][1] += 1
    sources = sorted(((s, b, c) for s, (b, c) in grouped.items()), key=lambda r: -r[1])
    return PeakCensus(baseline=baseline, peak=peak, sources=sources, events=events)


def record_step_memory(step: Callable[[], object], device: int | None = None,
                       max_entries: int = 500_000) -> PeakCensus:
    """Run ``step`` once under the CUDA allocator's history and return its :class:`PeakCensus`."""
    import torch

    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated(device)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    index = torch.cuda.current_device() if device is None else device
    traces = snapshot.get("device_traces", [])
    return live_at_peak(traces[index] if index < len(traces) else [], baseline)
