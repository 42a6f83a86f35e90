"""Input pipeline: data-wait time per step with and without prefetching reader workers.

Writes a synthetic store in anemoi's layout (O96 by default: 40,320 cells; ``--grid o320`` is
N320-sized) with compressed chunks in anemoi's chunking ``(1, variables, 1, all cells)``, the
land-masked ``sst`` included, then runs a training-shaped loop: each micro-batch reads
``micro_batch`` windows of ``multistep_input + rollout`` dates of this rank's grid slice and
normalises them (:class:`~stormshard.data.loader.SliceBatchReader`, what the trainer's workers
run), then a stand-in "step" computes for a fixed time (single-threaded matrix products, so that
the readers have the other core). Prints, per configuration, step time and data wait per step,
their ratio, and the speed-up of prefetching over reading inline.

    python benchmarks/bench_input_pipeline.py [--grid o96] [--steps 30] [--workers 2] [--prefetch 2]
        [--compute-factor 1.5] [--gpus-per-model 1]

``--compute-factor``: the step's compute time as a multiple of the measured read time of one
micro-batch (above 1: reading is faster than computing, the case where the goal is a data wait
below 5% of the step).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch

from stormshard.data.anemoi_layout import AnemoiDataset
from stormshard.data.dataset import ResumableSampler, WindowedSampleDataset
from stormshard.data.loader import PrefetchLoader, SliceBatchReader, micro_batch_keys
from stormshard.data.normalisation import Normaliser
from stormshard.data.synthetic import generate_synthetic_dataset


def busy(seconds: float, x: torch.Tensor) -> None:
    """Compute (matrix products) for about ``seconds``."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        x = torch.tanh(x @ x)


def run(loader: PrefetchLoader, steps: int, compute: float) -> tuple[float, float]:
    """Mean step time and data wait per step over ``steps`` steps (after one warm-up step)."""
    x = torch.randn(192, 192) * 0.05
    next(loader)
    busy(compute, x)
    start_wait, tic = loader.wait_time, time.perf_counter()
    for _ in range(steps):
        next(loader)
        busy(compute, x)
    return (time.perf_counter() - tic) / steps, (loader.wait_time - start_wait) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--grid", default="o96")
    parser.add_argument("--dates", type=int, default=48)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--prefetch", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--rollout", type=int, default=1)
    parser.add_argument("--compute-factor", type=float, default=1.5)
    parser.add_argument("--gpus-per-model", type=int, default=1, help="read this rank's 1/k slice of the grid")
    parser.add_argument("--store", default=None, help="reuse or write the store here (default: a temp dir)")
    parser.add_argument("--quick", action="store_true", help="an O32 grid, 8 dates, 6 steps (make bench)")
    args = parser.parse_args()
    if args.quick:
        args.grid, args.dates, args.steps = "o32", 8, 6
    torch.set_num_threads(1)

    tmp = tempfile.TemporaryDirectory()
    path = args.store or os.path.join(tmp.name, f"synthetic_{args.grid}.zarr")
    if not os.path.exists(path):
        tic = time.perf_counter()
        generate_synthetic_dataset(path, grid=args.grid, steps=args.dates, sea_field=True)
        print(f"wrote {path} in {time.perf_counter() - tic:.1f} s")
    ds = AnemoiDataset.open(path)
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(os.path.join(path, "data")) for f in fs)
    print(f"store: {ds.num_cells:,} cells x {ds.num_variables} variables x {ds.num_dates} dates, chunks "
          f"{tuple(ds.data.chunks)}, compressor {ds.data.metadata.compressor}, "
          f"{size / 2**20:.1f} MiB on disk ({size / (ds.data.nbytes):.2f} of raw)")

    samples = WindowedSampleDataset(ds, multistep_input=2, rollout=args.rollout, ensemble="each")
    norm = Normaliser.from_statistics(ds.statistics, ds.variables)
    cells = ds.num_cells // args.gpus_per_model
    read = SliceBatchReader(samples, slice(0, cells), norm.offset, norm.scale)
    times = 2 + args.rollout

    def keys():  # noqa: ANN202
        return micro_batch_keys(ResumableSampler(len(samples), seed=0), args.micro_batch, 1, 0, lambda s: times)

    stream = keys()
    read(next(stream))  # warm the page cache and zarr
    tic = time.perf_counter()
    for _ in range(10):
        read(next(stream))
    read_time = (time.perf_counter() - tic) / 10
    compute = args.compute_factor * read_time
    print(f"one micro-batch: {args.micro_batch} windows x {times} dates of {cells:,} cells (1/{args.gpus_per_model} "
          f"of the grid; whole chunks are decoded): read + normalise {read_time * 1e3:.1f} ms; stand-in compute "
          f"{compute * 1e3:.1f} ms per step ({args.compute_factor}x)")

    rows = []
    for name, workers, kind in (("inline (no prefetch)", 0, "auto"), (f"{args.workers} threads", args.workers, "threads"),
                                (f"{args.workers} processes", args.workers, "processes")):
        with PrefetchLoader(keys(), read, num_workers=workers, prefetch=args.prefetch, worker_type=kind) as loader:
            step, wait = run(loader, args.steps, compute)
        rows.append((name, step, wait))
    base = rows[0][1]
    print(f"\n{'reading':<22} {'step ms':>9} {'data wait ms':>13} {'wait/step':>10} {'speed-up':>9}")
    for name, step, wait in rows:
        print(f"{name:<22} {step * 1e3:9.1f} {wait * 1e3:13.2f} {wait / step:10.1%} {base / step:8.2f}x")
    best = min(rows[1:], key=lambda r: r[2])
    print(f"\nprefetch ({best[0]}, prefetch {args.prefetch}): data wait {best[2] / best[1]:.1%} of the step "
          f"(goal < 5% when reading is faster than computing), {base / best[1]:.2f}x the inline step rate")
    tmp.cleanup()


if __name__ == "__main__":
    main()
