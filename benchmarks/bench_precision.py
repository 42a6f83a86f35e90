"""bf16 against fp32: step time and peak memory of one training step of an AIFS-like model.

    python benchmarks/bench_precision.py            # O96 data -> O48 hidden, 512 channels, 8 layers (a GPU)
    python benchmarks/bench_precision.py --quick    # O16 -> O8, 64 channels, 2 layers (CPU, seconds)

One process, on CUDA when available (else CPU, where bf16 is only meaningful with native bf16
instructions). Each precision runs the same model from the same seed: forward (the
encoder-processor-decoder with activation checkpointing), an MSE loss in fp32, backward and an
AdamW step over fp32 parameters, exactly what ``training.precision`` selects for the local / DDP
engines and DeepSpeed at ZeRO 0:

- ``fp32``: everything in fp32 (TF32 matmuls off, so fp32 means fp32);
- ``bf16``: the forward under ``torch.autocast(bfloat16)`` (softmax statistics in fp32 inside the
  window kernel and graph attention), fp32 master weights, gradients and optimizer.

Prints the median step time over the timed steps (after warm-up), the bf16/fp32 speed-up, the
peak device memory of each and their ratio, and the relative difference of the first loss.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stormshard.graphs.builder import GraphConfig, KNNEdges, build_graph  # noqa: E402
from stormshard.models.config import ModelConfig  # noqa: E402
from stormshard.models.registry import build_model  # noqa: E402
from stormshard.models.variables import VariableIndex  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    data_grid: str
    hidden: str
    channels: int
    layers: int
    heads: int
    window: int
    variables: int
    batch: int
    steps: int


FULL = Sizes("o96", "o48", 512, 8, 16, 512, 64, 1, 6)
QUICK = Sizes("o16", "o8", 64, 2, 4, 32, 8, 1, 3)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")


def run(precision: str, s: Sizes, graph, variables: VariableIndex, device: torch.device) -> tuple[float, float, float]:  # noqa: ANN001
    """Median step seconds, peak MiB and the first loss for ``precision`` ("fp32" or "bf16")."""
    config = ModelConfig(name="transformer", num_channels=s.channels, multistep_input=2, trainable_size=8,
                         processor=dict(num_layers=s.layers, num_heads=s.heads, window_size=s.window, mlp_ratio=4),
                         encoder=dict(num_heads=s.heads // 2, num_chunks=2), decoder=dict(num_heads=s.heads // 2,
                                                                                           num_chunks=2),
                         activation_checkpointing=True)
    torch.manual_seed(0)
    model = build_model(config, graph, variables).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    cells, n_in = graph["data"].num_nodes, len(variables.input_names)
    x = torch.randn(s.batch, 2, cells, n_in, generator=gen).to(device)
    target = torch.randn(s.batch, cells, len(variables.output_names), generator=gen).to(device)
    times, first_loss = [], float("nan")
    _peak_reset(device)
    for step in range(s.steps + 1):  # step 0 warms up
        _sync(device)
        tic = time.perf_counter()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            pred = model(x)
        loss = (pred.float() - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        _sync(device)
        if step == 0:
            first_loss = float(loss.detach())
        else:
            times.append(time.perf_counter() - tic)
    return statistics.median(times), _peak_mib(device), first_loss


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (CPU, seconds)")
    args = parser.parse_args(argv)
    s = QUICK if args.quick else FULL
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    names = [f"var_{i}" for i in range(s.variables)]
    variables = VariableIndex.build(names, forcing=names[-2:], diagnostic=[])
    graph = build_graph(GraphConfig(data_grid=s.data_grid, hidden=s.hidden, processor=KNNEdges(num_neighbours=8)))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device: {name}; data {s.data_grid} ({graph['data'].num_nodes} cells) -> hidden {s.hidden} "
          f"({graph['hidden'].num_nodes} nodes), {s.channels} channels, {s.layers} layers, window {s.window}, "
          f"batch {s.batch}, activation checkpointing; median of {s.steps} steps after 1 warm-up")
    results = {p: run(p, s, graph, variables, device) for p in ("fp32", "bf16")}
    for p, (sec, mib, loss) in results.items():
        print(f"  {p}: {sec * 1e3:8.1f} ms/step   peak {mib:8.0f} MiB   first loss {loss:.5f}")
    (t32, m32, l32), (t16, m16, l16) = results["fp32"], results["bf16"]
    print(f"bf16 vs fp32: speed-up {t32 / t16:.2f}x, peak memory {m16 / m32:.2f}x, "
          f"first-loss relative difference {abs(l16 - l32) / abs(l32):.1e}")


if __name__ == "__main__":
    main()
