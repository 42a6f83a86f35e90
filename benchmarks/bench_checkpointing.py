"""Selective against full activation checkpointing: one whole training step, same process.

    python benchmarks/bench_checkpointing.py [--quick] [--size SIZE] [--rounds N] [--steps N] [--json PATH]

The ``transformer`` model of ``bench_gpu_vs_anemoi.py`` (graph-transformer encoder and decoder, sliding-window
processor, every processor block checkpointed), the same weights and inputs in every row; one step is forward,
fp32 MSE loss, backward and AdamW (``bench_gpu.mse_training_step``). Rows:

- **full** (the baseline): ``model.activation_checkpointing: true``, the backward recomputes each block whole;
- **selective**: ``"selective"``, the blocks' attention outputs kept (:mod:`stormshard.layers.checkpointing`):
  the recompute runs the norms and products, no attention forward;
- **selective, torch's modes** (eager runs only): the same with every wrapper's ``own_keeping`` off, so that
  torch's selective checkpointing watches every operator through its dispatch modes in each step, where the
  selective row lets stormshard's kernels keep their own outputs (:mod:`stormshard.kernels.kept_outputs`):
  what that mechanism saves;
- **selective + encoder**: the same with the encoder checkpointed too (``model.encoder.activation_checkpointing:
  "selective"``): what remaking the encoder's keys, values and norms in its backward costs (it frees them for
  the rest of the step: 2.7 GiB of the simulated AIFS-size peak, ``bench_memory.py``).

On a CPU (``--quick``: O32 -> O16, 128 channels, 4 layers, window 64; default O48 -> O24, 256 channels,
8 layers, window 200): fp32, eager, the banded window kernel; on CUDA (``--size aifs`` or ``o96``, any size of
``bench_gpu_vs_anemoi.py`` with checkpointing forced on): bf16 autocast, compiled blocks (``training.compile``'s
default there), flex attention. The rows alternate, ``--rounds`` times ``--steps`` timed steps after a warm-up
each; it prints the median step of each row, the ratios (full / selective: above 1, selective is faster),
whether the rows' losses are equal (the same model), and the bytes the selective row keeps more per step
(``layers x hidden nodes x (channels x activation bytes + heads x 4)``: each layer's attention output and
fp32 log-sum-exp). ``benchmarks/bench_memory.py`` simulates the peak at the AIFS size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

import bench_gpu_vs_anemoi as h2h  # noqa: E402
import torch  # noqa: E402
from bench_gpu import mse_training_step  # noqa: E402

TORCH_MODES = "selective, torch's modes"
CPU_SIZES = {
    "cpu-quick": h2h.Size("cpu-quick", "o32", "o16", 128, 4, 8, 64, True, 8, 1, knn=8),
    "cpu": h2h.Size("cpu", "o48", "o24", 256, 8, 8, 200, True, 16, 2, knn=8),
}


def _size(name: str) -> h2h.Size:
    if name in CPU_SIZES:
        return CPU_SIZES[name]
    if name not in h2h.SIZES:
        raise SystemExit(f"--size {name!r}: use one of {', '.join([*CPU_SIZES, *h2h.SIZES])}")
    return dataclasses.replace(h2h.SIZES[name], checkpointing=True)


def _steps(size: h2h.Size, device: torch.device, compiled: bool) -> dict:
    """The rows' step functions, built from one set of weights and one input."""
    from stormshard.layers.checkpointing import ActivationCheckpoint
    from stormshard.models.compile import compile_blocks
    from stormshard.models.registry import build_model
    from stormshard.training.engine.adamw import build_adamw

    graph, _path = h2h.size_graph(size)
    variables, config = h2h.size_variables(size), h2h.size_config(size)
    torch.manual_seed(0)
    weights = build_model(config, graph, variables).state_dict()
    x, target = h2h.model_inputs(graph, variables, device)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    steps = {}
    encoder = config.encoder.model_copy(update={"activation_checkpointing": "selective"})
    rows = [("full", {"activation_checkpointing": True}), ("selective", {"activation_checkpointing": "selective"})]
    if not compiled:
        rows.append((TORCH_MODES, {"activation_checkpointing": "selective"}))
    rows.append(("selective + encoder", {"activation_checkpointing": "selective", "encoder": encoder}))
    for name, update in rows:
        model = build_model(config.model_copy(update=update), graph, variables)
        if name == TORCH_MODES:
            for wrapper in model.modules():
                if isinstance(wrapper, ActivationCheckpoint):
                    wrapper.own_keeping = False
        model.load_state_dict(weights)
        model.to(device)
        if compiled:
            compile_blocks(model)
        optimizer = build_adamw(model.parameters(), lr=1e-4)
        steps[name] = mse_training_step(model, optimizer, x, target, autocast)
    return steps


def _timed(step, device: torch.device) -> tuple[float, float]:  # noqa: ANN001
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    tic = time.perf_counter()
    loss = step()  # returns the loss: a host sync
    return time.perf_counter() - tic, loss


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the small CPU size, 2 rounds (make bench)")
    parser.add_argument("--size", default=None, help="cpu-quick, cpu (the CPU default) or a bench_gpu_vs_anemoi size "
                        "(the CUDA default: aifs)")
    parser.add_argument("--rounds", type=int, default=None, help="alternations of the rows (default 3; quick 2)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per row and round")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    size = _size(args.size or ("cpu-quick" if args.quick else "aifs" if cuda else "cpu"))
    rounds = args.rounds or (2 if args.quick else 3)
    steps = _steps(size, device, compiled=cuda)
    losses: dict[str, list[float]] = {name: [] for name in steps}
    times: dict[str, list[float]] = {name: [] for name in steps}
    for name, step in steps.items():  # warm-up (compiles on CUDA), and AdamW's state made
        losses[name].append(step())
    for _ in range(rounds):
        for name, step in steps.items():
            for _ in range(args.steps):
                seconds, loss = _timed(step, device)
                times[name].append(seconds)
                losses[name].append(loss)
    graph, _path = h2h.size_graph(size)
    hidden = graph["hidden"].num_nodes
    kept = size.layers * hidden * (size.channels * (2 if cuda else 4) + size.heads * 4)
    median = {name: statistics.median(t) for name, t in times.items()}
    print(f"activation checkpointing, one training step on {device.type} "
          f"({'bf16 autocast, compiled blocks' if cuda else f'fp32 eager, {torch.get_num_threads()} threads'}): "
          f"{size.label}; {rounds} rounds x {args.steps} steps per row, alternating\n")
    print("| checkpointing | step ms (median) | min | max | losses equal |")
    print("|---|---|---|---|---|")
    same = all(abs(a - b) <= 1e-5 * max(abs(a), abs(b), 1e-12) for row in zip(*losses.values(), strict=True)
               for a, b in zip(row, row[1:], strict=False))
    for name, t in times.items():
        print(f"| {name} | {1e3 * median[name]:.1f} | {1e3 * min(t):.1f} | {1e3 * max(t):.1f} | {same} |")
    print(f"\nselective vs full: {median['full'] / median['selective']:.2f}x faster (full ms / selective ms); "
          f"it keeps {kept / 2**20:.1f} MiB more per step (each layer's attention output and log-sum-exp)")
    if TORCH_MODES in median:
        print(f"selective, kernels keeping their outputs vs torch's modes: "
              f"{median[TORCH_MODES] / median['selective']:.2f}x")
    print(f"selective + encoder vs full: {median['full'] / median['selective + encoder']:.2f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": dataclasses.asdict(size), "device": str(device), "times": times, "losses": losses,
                       "ratio": median["full"] / median["selective"],
                       "ratio_encoder": median["full"] / median["selective + encoder"], "kept_bytes": kept,
                       "ratio_own_keeping": median[TORCH_MODES] / median["selective"] if TORCH_MODES in median else None},
                      f, indent=1)
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
