"""``benchmarks/memory_census.py``: the peak of an allocator trace and what is alive there, by source line
(made-up traces in torch's snapshot format; the CUDA recording runs in ``bench_gpu_vs_anemoi.py
--memory-census`` on a GPU)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "memory_census.py"
_spec = importlib.util.spec_from_file_location("memory_census", _PATH)
memory_census = importlib.util.module_from_spec(_spec)
sys.modules["memory_census"] = memory_census
_spec.loader.exec_module(memory_census)

MLP = {"filename": "/x/stormshard/layers/mlp.py", "line": 26, "name": "forward"}
KERNEL = {"filename": "/x/stormshard/kernels/graph_triton.py", "line": 250, "name": "_backward"}
TORCH = {"filename": "/venv/lib/torch/nn/functional.py", "line": 10, "name": "linear"}
INDUCTOR = {"filename": "/tmp/torchinductor_root/ab/cabc123.py", "line": 99, "name": "call"}
BENCH = {"filename": "/x/benchmarks/bench_gpu.py", "line": 191, "name": "step"}


def _alloc(addr: int, size: int, *frames: dict) -> dict:
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames)}


def _free(addr: int, size: int) -> dict:
    return {"action": "free_completed", "addr": addr, "size": size}


def test_the_peak_and_what_is_alive_there():
    trace = [
        _alloc(1, 100, TORCH, MLP, BENCH),  # an MLP activation (torch frame innermost)
        _alloc(2, 50, KERNEL, BENCH),
        {"action": "free_requested", "addr": 2, "size": 50},  # not yet free: counts until free_completed
        _alloc(3, 300, INDUCTOR, BENCH),  # peak here: 1000 + 100 + 50 + 300
        _free(2, 50),
        _free(3, 300),
        _alloc(4, 200, TORCH, MLP),  # 1000 + 100 + 200 < the peak
        _free(99, 10),  # a baseline allocation freed during the step
    ]
    census = memory_census.live_at_peak(trace, baseline=1000)
    assert census.peak == 1450 and census.baseline == 1000 and census.events == 7
    assert census.sources == [(memory_census.COMPILED, 300, 1), ("stormshard/layers/mlp.py:26 forward", 100, 1),
                              ("stormshard/kernels/graph_triton.py:250 _backward", 50, 1)]
    text = census.table(top=2)
    assert "1 other sources" in text and "compiled block" in text


def test_sources_fall_back_to_the_innermost_frame_outside_torch():
    assert memory_census.source_of([TORCH, BENCH]) == "bench_gpu.py:191 step"
    assert memory_census.source_of([TORCH]) == "torch"
    assert memory_census.source_of([]) == "torch"
    same = [_alloc(i, 8, TORCH, MLP) for i in range(5)]
    census = memory_census.live_at_peak(same)
    assert census.sources == [("stormshard/layers/mlp.py:26 forward", 40, 5)] and census.peak == 40
