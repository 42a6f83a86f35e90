"""The truncated residual on a sharded grid: stormshard's partial sums + one all-reduce of the coarse field
against gathering the grid first, on 2 gloo ranks (CPU): time of forward + backward and bytes per step.

- ``stormshard`` (:class:`~stormshard.layers.truncation.TruncatedResidual`): each rank multiplies its columns of
  ``A_down``, one all-reduce sums the ``(truncation nodes, batch x variables)`` field, each rank applies its rows
  of ``A_up``; the backward all-reduces that field's gradient once;
- ``gather`` (the baseline, the plain way to shard a global operator): all-gather the grid (``sync_tensor``:
  backward reduce-scatter), apply both projections to the whole grid on every rank, keep this rank's rows.
  (anemoi's ``TruncatedConnection`` transposes grid shards into channel shards with two all-to-alls each way,
  moving the whole field as well.)

Both give the same output and input gradient (checked here, float64 tolerance). Bytes are those a rank sends,
counted by :class:`~stormshard.parallel.counter.CommCounter` (the accounting of every stormshard collective).
The last line computes the same per-step bytes at the AIFS size (N320-like 542,080 data points, O32 truncation
grid, 100 prognostic variables, 4 ranks per model) from the counter's formulas.

    python benchmarks/bench_truncation.py [--quick] [--grid o48] [--truncation o16] [--variables 40]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stormshard.graphs.builder import (  # noqa: E402
    TRUNCATION_DOWN,
    TRUNCATION_UP,
    GraphConfig,
    KNNEdges,
    TruncationGrid,
    build_graph,
)
from stormshard.graphs.grids import grid_from_name  # noqa: E402
from stormshard.kernels.sparse_projection import csr_pair, sparse_project  # noqa: E402
from stormshard.layers.truncation import TruncatedResidual  # noqa: E402
from stormshard.parallel.comm import ring_all_reduce_bytes, sync_tensor  # noqa: E402
from stormshard.parallel.counter import CommCounter  # noqa: E402
from stormshard.parallel.shard import SequenceShard  # noqa: E402

WORLD = 2


def _gathered(graph, shard: SequenceShard):  # noqa: ANN001, ANN202 - the baseline as a function of x
    """The baseline: all-gather the grid, both projections on the whole grid, this rank's rows."""
    n_data, n_trunc = graph["data"].num_nodes, graph["truncation"].num_nodes
    down, up = graph[TRUNCATION_DOWN], graph[TRUNCATION_UP]
    a_down = csr_pair(down.edge_index[1], down.edge_index[0], down.edge_weight, (n_trunc, n_data))
    a_up = csr_pair(up.edge_index[1], up.edge_index[0], up.edge_weight, (n_data, n_trunc))
    rows = shard.local_slice

    def forward(x: torch.Tensor) -> torch.Tensor:  # (batch, grid_local, vars)
        full = sync_tensor(x, 1, [(x.shape[0], n, x.shape[2]) for n in shard.sizes], shard.group)
        b = full.shape[0]
        cols = full.permute(1, 0, 2).reshape(n_data, -1)
        out = sparse_project(sparse_project(cols, a_down, (n_trunc, n_data)), a_up, (n_data, n_trunc))
        return out[rows].reshape(-1, b, x.shape[2]).permute(1, 0, 2)

    return forward


def _time(fn, x: torch.Tensor, grad: torch.Tensor, repeat: int) -> tuple[list[float], int]:  # noqa: ANN001
    """Per-step seconds (forward + backward) and the bytes one step sends."""
    times = []
    for i in range(repeat + 1):
        xi = x.clone().requires_grad_()
        dist.barrier()
        with CommCounter() as counter:
            tic = time.perf_counter()
            fn(xi).backward(grad)
            elapsed = time.perf_counter() - tic
        if i:  # the first is a warm-up
            times.append(elapsed)
    return times, counter.total_bytes


def _worker(rank: int, port: int, args: argparse.Namespace, queue) -> None:  # noqa: ANN001
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=timedelta(seconds=600))
    try:
        graph = build_graph(GraphConfig(data_grid=args.grid, hidden="o2", processor=KNNEdges(num_neighbours=4),
                                        truncation=TruncationGrid(grid=args.truncation)))
        shard = SequenceShard.balanced(graph["data"].num_nodes, dist.group.WORLD)
        down, up = graph[TRUNCATION_DOWN], graph[TRUNCATION_UP]
        ours = TruncatedResidual(down.edge_index, down.edge_weight, up.edge_index, up.edge_weight,
                                 graph["truncation"].num_nodes, shard)
        baseline = _gathered(graph, shard)
        g = torch.Generator().manual_seed(0)
        full_x = torch.randn(args.batch, graph["data"].num_nodes, args.variables, generator=g)
        full_grad = torch.randn(full_x.shape, generator=g)
        x, grad = full_x[:, shard.local_slice].contiguous(), full_grad[:, shard.local_slice].contiguous()
        # the same numbers first (float64)
        outs = []
        for fn in (ours, baseline):
            xi = x.double().requires_grad_()
            out = fn(xi)
            out.backward(grad.double())
            outs.append((out.detach(), xi.grad))
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
        results = {}
        for _ in range(args.rounds):  # alternate, so both share the machine's background load
            for name, fn in (("gather", baseline), ("stormshard", ours)):
                times, sent = _time(fn, x, grad, args.repeat)
                results.setdefault(name, ([], sent))[0].extend(times)
        if rank == 0:
            queue.put({"cells": graph["data"].num_nodes, "truncation": graph["truncation"].num_nodes,
                       **{k: (statistics.median(t), b) for k, (t, b) in results.items()}})
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def aifs_bytes(world: int = 4, cells: int = 542_080, variables: int = 100, batch: int = 1) -> tuple[int, int]:
    """Per-step bytes one rank sends (fp32), forward + backward: (stormshard, gather), at the AIFS size."""
    trunc = grid_from_name("o32")[0].size
    ours = 2 * ring_all_reduce_bytes(trunc * batch * variables, 4, world)
    local = cells // world
    gather = (world - 1) * local * batch * variables * 4 + ring_all_reduce_bytes(cells * batch * variables, 4,
                                                                                world) // 2
    return ours, gather


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="o32 data, o8 truncation, 2 rounds")
    parser.add_argument("--grid", default="o64")
    parser.add_argument("--truncation", default="o16")
    parser.add_argument("--variables", type=int, default=40)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        args.grid, args.truncation, args.rounds = "o32", "o8", 2
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, args, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    result = queue.get(timeout=900)
    for p in procs:
        p.join()
    if any(p.exitcode for p in procs):
        sys.exit(1)
    base_t, base_b = result["gather"]
    ours_t, ours_b = result["stormshard"]
    print(f"truncated residual, {WORLD} gloo ranks: {args.grid} data ({result['cells']:,} cells) -> {args.truncation} "
          f"({result['truncation']:,} nodes), batch {args.batch} x {args.variables} variables, fp32, forward + backward")
    print("| variant | ms / step | bytes sent / step / rank | speed-up | bytes vs gather |")
    print("|---|---|---|---|---|")
    print(f"| gather (baseline) | {base_t * 1e3:.2f} | {base_b:,} | 1.00x | 1.00x |")
    print(f"| stormshard | {ours_t * 1e3:.2f} | {ours_b:,} | {base_t / ours_t:.2f}x | {ours_b / base_b:.3f}x |")
    ours, gather = aifs_bytes()
    print(f"computed at the AIFS size (542,080 cells, O32 truncation, 100 variables, 4 ranks): stormshard "
          f"{ours / 2**20:.1f} MiB, gather {gather / 2**20:.1f} MiB per step and rank ({ours / gather:.3f}x)")


if __name__ == "__main__":
    main()
