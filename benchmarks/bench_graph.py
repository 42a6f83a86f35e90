"""Graph sharding benchmark: an O96 -> icosahedral (level 5) graph-transformer encoder on 2 ranks.

Reports, per rank:

1. bytes sent by the destination-node halo plan vs a full all-gather of the source nodes, from the
   plans of the encoder, processor and decoder (2 and 4 ranks), for the builder's hidden-node order
   and for hidden nodes sorted by latitude (contiguous slices then cover latitude bands, like the
   O96 ring order of the data nodes);
2. a real 2-rank run (gloo) of the encoder and decoder ``GraphTransformerMapperBlock`` (forward +
   backward): measured bytes (CommCounter) of the halo exchange vs an all-gather (``sync_tensor``)
   of the same sources, time, and per-rank peak memory with 1 and 4 edge chunks; and, as the
   baseline, the same block fed with all-gathered sources (what anemoi's mappers do).

Peak memory: the torch profiler's CPU memory events (``profile_memory=True``; every allocation
and free of torch's CPU allocator, summed in time order), i.e. the peak of the bytes allocated
above what was live when the step began (inputs, parameters and the graph are not counted).
tracemalloc would miss torch's allocations, which do not go through Python's allocator.

``python benchmarks/bench_graph.py`` (O96 -> ico5, 128 channels) or ``--quick`` (O48 -> ico4, 64
channels). Numbers in the README were taken on a shared 2-core CPU machine (other jobs running).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stormshard.graphs.builder import DECODER, ENCODER, PROCESSOR, GraphConfig, build_graph  # noqa: E402
from stormshard.layers.graph_transformer import GraphTransformerMapperBlock  # noqa: E402
from stormshard.parallel import comm  # noqa: E402
from stormshard.parallel.counter import CommCounter  # noqa: E402
from stormshard.parallel.graph import GraphShardPlan  # noqa: E402


def latitude_order(latlon: torch.Tensor) -> torch.Tensor:
    """``new_id`` per node: nodes sorted north to south, then by longitude."""
    lat, lon = latlon[:, 0].double().numpy(), latlon[:, 1].double().numpy()
    order = np.lexsort((np.round(lon, 9), -np.round(lat, 9)))
    new_id = torch.empty(len(order), dtype=torch.long)
    new_id[torch.from_numpy(order)] = torch.arange(len(order))
    return new_id


def relabel_hidden(graph, new_id: torch.Tensor) -> dict:
    """Edge indices of the three sub-graphs with the hidden nodes renumbered by ``new_id``."""
    out = {}
    for edge_type in (ENCODER, PROCESSOR, DECODER):
        ei = graph[edge_type].edge_index.clone()
        for row, name in ((0, edge_type[0]), (1, edge_type[2])):
            if name == "hidden":
                ei[row] = new_id[ei[row]]
        out[edge_type] = ei
    return out


def plan_table(graph, channels: int) -> list[dict]:
    """Halo vs all-gather bytes per rank, from the plans alone (no communication)."""
    num = {"data": graph["data"].num_nodes, "hidden": graph["hidden"].num_nodes}
    orders = {
        "builder order": {et: graph[et].edge_index for et in (ENCODER, PROCESSOR, DECODER)},
        "hidden by latitude": relabel_hidden(graph, latitude_order(graph["hidden"].x)),
    }
    rows = []
    row_bytes = channels * 4  # float32 features
    for order_name, edges in orders.items():
        for edge_type, label in ((ENCODER, "encoder"), (PROCESSOR, "processor"), (DECODER, "decoder")):
            nodes = (num[edge_type[0]], num[edge_type[2]])
            for world in (2, 4):
                plans = [GraphShardPlan.for_rank(edges[edge_type], nodes, world, r) for r in range(world)]
                halo = [p.halo_bytes(row_bytes) for p in plans]
                gather = [p.all_gather_bytes(row_bytes) for p in plans]
                rows.append(dict(order=order_name, graph=label, world=world, halo_bytes=halo, gather_bytes=gather,
                                 edges=list(plans[0].edges_per_rank)))
    return rows


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _peak_bytes(fn) -> int:  # noqa: ANN001
    """Peak bytes allocated above the start during one ``fn()``, from torch profiler memory events."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    mem = sorted((e["ts"], e["args"]["Bytes"]) for e in events if e.get("name") == "[memory]")
    live = peak = 0
    for _, nbytes in mem:
        live += nbytes
        peak = max(peak, live)
    return peak


def _interleaved_times(fns: dict, rounds: int) -> dict:
    """Median seconds per function, timed in interleaved rounds (every rank starts each call together)."""
    seconds: dict = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            seconds[name].append(time.perf_counter() - t0)
    return {name: float(np.median(v)) for name, v in seconds.items()}


def _rank_main(rank: int, world: int, port: int, setups: list[dict], results) -> None:  # noqa: ANN001
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    for setup in setups:
        results.put(_measure_mapper(rank, dist.group.WORLD, setup))
    dist.barrier()
    dist.destroy_process_group()


def _measure_mapper(rank: int, group, setup: dict) -> dict:  # noqa: ANN001
    edge_index, edge_attr = setup["edge_index"], setup["edge_attr"]
    num_src, num_dst, channels, heads = setup["num_src"], setup["num_dst"], setup["channels"], setup["heads"]
    plan = GraphShardPlan.build(edge_index, (num_src, num_dst), group)
    g = torch.Generator().manual_seed(0)
    x_src = plan.shard_src(torch.randn(num_src, channels, generator=g))
    x_dst = plan.shard_dst(torch.randn(num_dst, channels, generator=g))
    attr = plan.shard_edges(edge_attr)
    out = {"name": setup["name"], "rank": rank, "edges": plan.num_edges_local, "halo_rows": plan.num_halo}

    # bytes: the halo exchange vs an all-gather of the same source rows (both forward + backward)
    sizes = [[s, channels] for s in plan.src_sizes]
    for name, fn in (("halo", plan.exchange_halo),
                     ("all_gather", lambda x: comm.sync_tensor(x, 0, sizes, group))):
        x = x_src.clone().requires_grad_()
        with CommCounter() as counter:
            fn(x).sum().backward()
        out[f"{name}_bytes"] = counter.total_bytes

    steps = {}
    for num_chunks in (1, 4):
        torch.manual_seed(0)
        block = GraphTransformerMapperBlock(channels, channels, edge_attr.shape[1], heads, plan, num_chunks=num_chunks)

        def step(block=block) -> None:
            xs, xd = x_src.clone().requires_grad_(), x_dst.clone().requires_grad_()
            block(xs, xd, attr).square().mean().backward()

        steps[str(num_chunks)] = step

    # baseline (anemoi's mappers): all-gather every source row, then the same block on global source
    # ids: a one-rank plan of this rank's edges from all sources to its destination rows (the edges
    # are already sorted by destination, so that plan keeps their order and ``attr`` fits it)
    mine = edge_index[:, plan.edge_ids]
    gathered_index = torch.stack([mine[0], mine[1] - plan.dst_offset])
    gathered_plan = GraphShardPlan.build(gathered_index, (num_src, plan.num_dst_local))
    torch.manual_seed(0)
    block = GraphTransformerMapperBlock(channels, channels, edge_attr.shape[1], heads, gathered_plan)

    def baseline() -> None:
        xs, xd = x_src.clone().requires_grad_(), x_dst.clone().requires_grad_()
        full = comm.sync_tensor(xs, 0, sizes, group)
        block(full, xd, attr).square().mean().backward()

    steps["gather"] = baseline
    for fn in steps.values():
        fn()  # warm-up
    for name, seconds in _interleaved_times(steps, setup["rounds"]).items():
        out[f"time_{name}"] = seconds
    for name, fn in steps.items():
        dist.barrier()
        out[f"peak_{name}"] = _peak_bytes(fn)
    return out


def run_two_ranks(setups: list[dict], world: int = 2) -> list[dict]:
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_rank_main, args=(world, _free_port(), setups, results), nprocs=world, start_method="spawn")
    out = [results.get() for _ in range(world * len(setups))]
    return sorted(out, key=lambda r: (r["name"], r["rank"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="O48 -> ico4, 64 channels")
    args = parser.parse_args()
    data_grid, hidden, channels, heads = ("o48", "ico4", 64, 4) if args.quick else ("o96", "ico5", 128, 8)

    t0 = time.perf_counter()
    graph = build_graph(GraphConfig(data_grid=data_grid, hidden=hidden))
    print(f"graph {data_grid} -> {hidden}: {graph['data'].num_nodes} data, {graph['hidden'].num_nodes} hidden nodes, "
          f"edges enc/proc/dec {graph[ENCODER].num_edges}/{graph[PROCESSOR].num_edges}/{graph[DECODER].num_edges} "
          f"(built in {time.perf_counter() - t0:.1f} s)")
    print("shared 2-core CPU machine, other jobs running: times are indicative only\n")

    print(f"1. bytes sent per rank per exchange (float32, {channels} channels): halo plan vs all-gather of sources")
    print(f"{'hidden order':<20}{'graph':<11}{'ranks':>5}  {'halo MB per rank':<28}{'all-gather MB':<16}{'ratio':>7}")
    for row in plan_table(graph, channels):
        halo = " ".join(f"{b / 1e6:.2f}" for b in row["halo_bytes"])
        ratio = sum(row["gather_bytes"]) / max(1, sum(row["halo_bytes"]))
        print(f"{row['order']:<20}{row['graph']:<11}{row['world']:>5}  {halo:<28}"
              f"{max(row['gather_bytes']) / 1e6:<16.2f}{ratio:>6.1f}x")

    edges = relabel_hidden(graph, latitude_order(graph["hidden"].x))
    setups = [
        dict(name=name, edge_index=edges[et], edge_attr=graph[et].edge_attr, num_src=graph[et[0]].num_nodes,
             num_dst=graph[et[2]].num_nodes, channels=channels, heads=heads,
             rounds=3 if args.quick else 5)
        for name, et in (("encoder", ENCODER), ("decoder", DECODER))
    ]
    print(f"\n2. GraphTransformerMapperBlock on 2 gloo ranks (hidden by latitude), {channels} channels, "
          f"{heads} heads, forward + backward, median of interleaved rounds")
    for r in run_two_ranks(setups):
        print(f"{r['name']} rank {r['rank']}: {r['edges']} edges, {r['halo_rows']} halo rows | bytes fwd+bwd: halo "
              f"{r['halo_bytes'] / 1e6:.2f} MB vs all-gather {r['all_gather_bytes'] / 1e6:.2f} MB "
              f"({r['all_gather_bytes'] / max(1, r['halo_bytes']):.1f}x) | peak memory (torch profiler, CPU): "
              f"1 chunk {r['peak_1'] / 2**20:.1f} MiB, 4 chunks {r['peak_4'] / 2**20:.1f} MiB "
              f"({r['peak_1'] / max(1, r['peak_4']):.2f}x lower) | time 1 chunk {r['time_1']:.2f} s, "
              f"4 chunks {r['time_4']:.2f} s\n    all-gather baseline (1 chunk): peak {r['peak_gather'] / 2**20:.1f} MiB "
              f"({r['peak_gather'] / max(1, r['peak_1']):.2f}x the halo plan's), time {r['time_gather']:.2f} s "
              f"({r['time_gather'] / max(1e-9, r['time_1']):.2f}x)")


if __name__ == "__main__":
    main()
