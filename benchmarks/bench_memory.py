"""Peak device memory of one training step, stormshard against its own plain blocks and anemoi-models, without a GPU.

    python benchmarks/bench_memory.py [--quick] [--size aifs|o96|...] [--top 12] [--json PATH]
        [--anemoi-python PY] [--decoder-chunks N] [--encoder-chunks N]

Every row is one eager training step (bf16 autocast, fp32 MSE loss, backward, AdamW) of the same model, the
``transformer`` model of ``bench_gpu_vs_anemoi.py`` at its size (``aifs``: O364 data, 543,088 points -> O96
hidden, 1,024 channels, 16 layers, window 1,120, processor blocks checkpointed; ``o96``: O96 -> O48, 512
channels), simulated on the CPU with fake tensors by ``benchmarks/memory_simulation.py``: what a CUDA step
allocates, with the kernels a CUDA step runs (the Triton graph kernel, flex attention), on any machine, in a
minute. Rows:

- **stormshard**: its defaults (the memory-lean paths of the graph-transformer blocks on where they pay: norms
  inside their projections, :mod:`stormshard.layers.norm_linear`; the row-chunked MLP with its norm inside,
  :mod:`stormshard.layers.row_chunked_mlp`);
- **stormshard, memory-lean paths off** (the baseline, same process): the same model with
  ``model.lean_activations: false``, every norm before its projection and plain MLPs, as the blocks were before;
- **stormshard, selective checkpointing** (sizes whose processor blocks are checkpointed): its defaults with
  ``model.activation_checkpointing: "selective"``, the attention outputs kept for the backward
  (:mod:`stormshard.layers.checkpointing`): what the recompute without an attention forward costs in memory;
  and the same with the encoder checkpointed too (``model.encoder.activation_checkpointing: "selective"``:
  its keys, values and norms on the data nodes no longer held through the step);
- **anemoi-models 0.19** (``--anemoi-python``, or ``$ANEMOI_PY``: an interpreter with anemoi-models, e.g. the one
  ``../shared/anemoi-bench/setup_env.sh`` builds; ``anemoi_side/memory_vs_stormshard.py``): anemoi's own model
  built from the same weights (as ``export-anemoi`` does), its Triton graph backend and flash-attn's window
  attention (its GPU default, by flash-attn v2's memory contract), with the head-to-head's matched checkpointing
  (processor blocks, mappers not) and with anemoi's default (mappers checkpointed too).

Columns: peak GiB (weights, AdamW state and the step's allocations alive at the peak), the ratio to the baseline
and to anemoi's matched row, and what holds the most at the peak. ``--quick`` (``make bench``): the ``o96``
size. The GPU measures the same (``bench_gpu_vs_anemoi.py --memory-census``, ``max_memory_allocated``), compiled
blocks included; the simulation leaves out the allocator's rounding, kernels' scratch space and CUDA's own
workspaces (``memory_simulation.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "anemoi_side"))

import memory_simulation as sim  # noqa: E402

GIB = 1024 ** 3
GET_ANEMOI = ("anemoi rows skipped: no --anemoi-python (or $ANEMOI_PY). Build one with "
              "ANEMOI_ENV=/tmp/anemoi-env bash ../shared/anemoi-bench/setup_env.sh, then pass "
              "--anemoi-python /tmp/anemoi-env/venv/bin/python")


def _checkpointed(size: str) -> bool:
    import bench_gpu_vs_anemoi as bench

    return bench.SIZES[size].checkpointing


def stormshard_row(size: str, lean: bool, encoder_chunks: int | None, decoder_chunks: int | None,
                   checkpointing: str | None = None, encoder_checkpointing: str | bool = False) -> dict:
    """One stormshard row: ``{"label", "peak", "parameters", "state", "sources", "largest"}``."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton graph kernel allowed on a CPU (never launched)
    step, parameters, mode, label = sim.stormshard_step(size, "bf16", encoder_chunks, decoder_chunks, lean,
                                                        checkpointing, encoder_checkpointing)
    with sim.cuda_kernels_on_fake_tensors(), mode:
        result = sim.simulate_step_memory(step, parameters, fake_mode=mode)
    return {"label": f"stormshard, {label}", "peak": result.census.peak, "parameters": result.parameters,
            "state": result.state, "sources": result.census.sources[:30], "largest": result.largest[:30],
            "table": result.table(30)}


def anemoi_row(python: str, size: str, mapper_checkpointing: bool) -> dict:
    """anemoi's row (``anemoi_side/memory_vs_stormshard.py`` in ``python``, stormshard on its path), or
    ``{"error": ...}``."""
    side = os.path.join(HERE, "anemoi_side", "memory_vs_stormshard.py")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (os.path.dirname(HERE),
                                                                  os.environ.get("PYTHONPATH", "")) if p))
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "anemoi.json")
        cmd = [python, side, "--size", size, "--attention", "flash", "--json", out]
        if mapper_checkpointing:
            cmd.append("--mapper-checkpointing")
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode or not os.path.exists(out):
            tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
            return {"error": f"the anemoi side exited {done.returncode}: {tail}"}
        with open(out) as f:
            return json.load(f)


def _largest(row: dict) -> str:
    sources = row.get("sources") or []
    return "; ".join(f"{src} {size / GIB:.2f}" for src, size, _count in sources[:2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the o96 size (make bench)")
    parser.add_argument("--size", default=None, help="a size of bench_gpu_vs_anemoi.py (default aifs; --quick: o96)")
    parser.add_argument("--encoder-chunks", type=int, default=None, help="the encoder's num_chunks")
    parser.add_argument("--decoder-chunks", type=int, default=None, help="the decoder's num_chunks")
    parser.add_argument("--anemoi-python", default=os.environ.get("ANEMOI_PY", "none"))
    parser.add_argument("--top", type=int, default=12, help="sources printed of stormshard's default row")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    size = args.size or ("o96" if args.quick else "aifs")

    rows = {"default": stormshard_row(size, True, args.encoder_chunks, args.decoder_chunks),
            "baseline": stormshard_row(size, False, args.encoder_chunks, args.decoder_chunks)}
    if _checkpointed(size):
        rows["selective"] = stormshard_row(size, True, args.encoder_chunks, args.decoder_chunks, "selective")
        rows["selective-encoder"] = stormshard_row(size, True, args.encoder_chunks, args.decoder_chunks, "selective",
                                                   "selective")
    if args.anemoi_python in ("", "none"):
        print(GET_ANEMOI)
    else:
        rows["anemoi"] = anemoi_row(args.anemoi_python, size, False)
        rows["anemoi-default"] = anemoi_row(args.anemoi_python, size, True)

    base, anemoi = rows["baseline"]["peak"], rows.get("anemoi", {}).get("peak")
    print(f"\nsimulated peak memory of one eager training step (fake tensors, CPU): {size}\n")
    print("| model | peak GiB | / lean paths off | / anemoi (matched) | largest at the peak (GiB) |")
    print("|---|---|---|---|---|")
    for key in ("default", "baseline", "selective", "selective-encoder", "anemoi", "anemoi-default"):
        row = rows.get(key)
        if row is None:
            continue
        if "error" in row:
            print(f"| anemoi-models ({key}) | error: {row['error'].splitlines()[-1][:120]} | | | |")
            continue
        peak = row["peak"]
        vs_anemoi = f"{peak / anemoi:.2f}x" if anemoi else ""
        print(f"| {row['label']} | {peak / GIB:.2f} | {peak / base:.2f}x | {vs_anemoi} | {_largest(row)} |")
    print()
    print(rows["default"]["table"].split("the largest tensors")[0].rstrip()
          if args.top <= 0 else "\n".join(rows["default"]["table"].splitlines()[:args.top + 3]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"size": size, "rows": {k: {kk: vv for kk, vv in v.items() if kk != "table"}
                                              for k, v in rows.items()}}, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
