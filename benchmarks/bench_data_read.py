"""Time reading training samples whole against one reader's share of a reader group, per chunking.

    python benchmarks/bench_data_read.py            # O96 (40,320 cells), 60 dates, 2 members
    python benchmarks/bench_data_read.py --quick    # O32 (5,248 cells), 30 dates, 1 member

Writes a synthetic store twice: with anemoi's default chunking (one chunk per date and member
holding the whole grid) and with the grid split into 16 chunks (``cells_per_chunk``). For read
groups of r = 1, 2, 4 it times one reader reading its ``1/r`` slice of every sample (the
baseline is r = 1, the whole sample, measured in the same run) and prints the bytes each reader
sends in the all-gather that shares the slices, ``(r - 1) x`` its (largest) slice.

Numbers are single-process timings on a shared 2-core machine (other jobs were running).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from stormshard.data.anemoi_layout import AnemoiDataset
from stormshard.data.dataset import WindowedSampleDataset
from stormshard.data.sharded_read import cell_shard
from stormshard.data.synthetic import generate_synthetic_dataset
from stormshard.graphs.grids import grid_from_name


def _time_reads(samples: WindowedSampleDataset, cells: slice, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for i in range(len(samples)):
            samples.read(i, cells=cells)
        best = min(best, time.perf_counter() - t)
    return best / len(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="O32, 30 dates, 1 member")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    grid, steps, members = ("o32", 30, 1) if args.quick else ("o96", 60, 2)
    print(f"shared 2-core CPU machine; {grid}, {steps} dates, {members} member(s); samples of 2 inputs + 1 target; "
          f"per-sample times are the best of {args.repeats} passes")
    with tempfile.TemporaryDirectory() as tmp:
        n_cells = len(grid_from_name(grid)[0])
        for label, per_chunk in (("anemoi chunks (whole grid)", None), ("grid in 16 chunks", -(-n_cells // 16))):
            path = Path(tmp) / f"{grid}-{per_chunk}.zarr"
            t = time.perf_counter()
            generate_synthetic_dataset(path, grid=grid, steps=steps, members=members, cells_per_chunk=per_chunk)
            write_s = time.perf_counter() - t
            ds = AnemoiDataset.open(path)
            samples = WindowedSampleDataset(ds, multistep_input=2, rollout=1)
            print(f"\n{label}: data chunks {ds.data.chunks}, written in {write_s:.1f} s")
            print(f"{'readers r':>10} {'ms/sample (reader 0)':>22} {'ratio to r=1':>14} {'all-gather bytes/rank':>22}")
            base = None
            for r in (1, 2, 4):
                shard = cell_shard(ds.num_cells, 0, r)
                per_sample = _time_reads(samples, shard.cells, args.repeats)
                base = base or per_sample
                sample_bytes = 3 * members * ds.num_variables * 4
                sent = (r - 1) * max(shard.sizes) * sample_bytes
                print(f"{r:>10} {per_sample * 1e3:>22.2f} {per_sample / base:>14.2f} {sent:>22,}")


if __name__ == "__main__":
    main()
