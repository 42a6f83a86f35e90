"""anemoi-models' GNN processor (N1) and GNN forward mapper (N2) on CPU: the anchor side of stormshard's
``benchmarks/bench_graph_vs_anemoi.py --compare --cases N1,N2`` (issue 14).

Run ONLY with the anemoi venv's python (``/tmp/anemoi-env/venv/bin/python``); stormshard never imports
this file. It reuses the graph builders of ``bench_graphtransformer.py`` and the timing / memory /
process-group helpers of ``common.py`` from the anemoi-bench folder (``--anemoi-bench`` or env
``ANEMOI_BENCH``, default ``/work/shared/anemoi-bench``), so the graphs, inputs, timing (one warm-up,
median of the timed steps, max over ranks, a barrier before every step) and peak-RSS accounting are
the graph-transformer benchmark's, and it prints the same ``RESULT ...`` line and writes the same JSON
(to ``$ANEMOI_BENCH_OUT``).

    PY=/tmp/anemoi-env/venv/bin/python
    $PY bench_gnn.py --component processor --nodes 4096 --k 8 --channels 256 --layers 16 --chunks 2 --ckpt 0 --threads 1
    $PY bench_gnn.py --component mapper --data-nodes 16384 --nodes 4096 --k-enc 4 --channels 256 --chunks 1 --ckpt 0 --steps 5
    $PY -m torch.distributed.run --standalone --nproc_per_node 2 bench_gnn.py --component processor ...

Models (AIFS GNN config defaults: ``mlp_extra_layers: 0``, ``mlp_hidden_ratio`` 1.0, processor
``num_chunks: 2`` (layer groups for checkpointing; no effect with ``--ckpt 0``), encoder ``num_chunks: 1``
(edge chunks), torch.nn kernels (Linear, LayerNorm, GELU)):

- N1 ``GNNProcessor``: 16 ``GraphConvProcessorBlock``; the first embeds the 4 edge attributes to C
  with an MLP (edge_dim 4), every block runs an edge MLP on ``[x_i, x_j, e_ji]`` (3C -> C), sums
  the updated edges ``e_ji + m_ji`` into the destinations and a node MLP on ``[x_i, agg]`` (2C -> C);
  each MLP is Linear, GELU, Linear, GELU, Linear, LayerNorm (``n_extra_layers = mlp_extra_layers + 1``).
- N2 ``GNNForwardMapper``: edge MLP embedding (4 -> C), source / destination node MLP embeddings
  (96 / 16 -> C), one ``GraphConvMapperBlock``; with ``update_src_nodes=True`` (anemoi's default
  for the forward mapper) it also updates the data nodes (``x_src + node_mlp([x_src, x_src])``),
  which this benchmark computes but does not back-propagate (its loss is on the hidden nodes, as G2's).

Two ranks: gloo, one model_comm_group of all ranks, node tensors sharded with anemoi's balanced
partition, edges sharded 1-hop inside the model (``shard_info.edges=None`` -> ``shard_edges_1hop``),
node features all-gathered per layer (``sync_tensor``), as anemoi does.
"""

from __future__ import annotations

import argparse
import os
import sys


def _anemoi_bench_dir() -> str:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--anemoi-bench", default=os.environ.get("ANEMOI_BENCH", "/work/shared/anemoi-bench"))
    known, _ = pre.parse_known_args()
    path = os.path.abspath(known.anemoi_bench)
    if not os.path.exists(os.path.join(path, "bench_graphtransformer.py")):
        raise SystemExit(f"no bench_graphtransformer.py in {path}: pass --anemoi-bench or set ANEMOI_BENCH")
    return path


ANEMOI_BENCH = _anemoi_bench_dir()
sys.path.insert(0, ANEMOI_BENCH)

import anemoi.models  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from anemoi.models.distributed.balanced_partition import get_balanced_partition_sizes, get_partition_range  # noqa: E402
from anemoi.models.distributed.graph import gather_tensor  # noqa: E402
from anemoi.models.distributed.shapes import BipartiteGraphShardInfo, GraphShardInfo  # noqa: E402
from anemoi.models.layers.mapper import GNNForwardMapper  # noqa: E402
from anemoi.models.layers.processor import GNNProcessor  # noqa: E402
from anemoi.models.layers.utils import load_layer_kernels  # noqa: E402
from bench_graphtransformer import encoder_graph, param_grad_errors, processor_graph  # noqa: E402
from common import (  # noqa: E402
    COMM,
    all_gather_obj,
    init_dist,
    install_comm_timer,
    max_over_ranks,
    now,
    peak_rss_mib,
    rel_err,
    rss_mib,
    timed_steps,
    write_json,
)

install_comm_timer()  # idempotent (bench_graphtransformer installed it on import)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--component", default="processor", choices=["processor", "mapper"])
    p.add_argument("--nodes", type=int, default=4096, help="hidden mesh nodes")
    p.add_argument("--data-nodes", type=int, default=16384, help="data grid nodes (mapper)")
    p.add_argument("--k", type=int, default=8, help="kNN for processor graph (before symmetrisation)")
    p.add_argument("--k-enc", type=int, default=4, help="hidden neighbours per data node (mapper)")
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--in-src", type=int, default=96, help="mapper input channels of data nodes")
    p.add_argument("--in-dst", type=int, default=16, help="mapper input channels of hidden nodes")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--mlp-extra-layers", type=int, default=0, help="anemoi's mlp_extra_layers (AIFS GNN: 0)")
    p.add_argument("--update-src-nodes", type=int, default=1,
                   help="mapper: GraphConvMapperBlock.update_src_nodes (anemoi's GNNForwardMapper: 1)")
    p.add_argument("--chunks", type=int, default=2,
                   help="processor: layer groups (checkpointing only); mapper: edge chunks")
    p.add_argument("--ckpt", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save-ref", action="store_true")
    p.add_argument("--anemoi-bench", default=ANEMOI_BENCH, help="folder of bench_graphtransformer.py / common.py")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    rank, world, group = init_dist()
    mgroup = group if world > 1 else None
    kernels = load_layer_kernels(instance=False)
    gen = torch.Generator().manual_seed(42)
    C = args.channels
    rss0 = rss_mib()

    if args.component == "processor":
        N = args.nodes
        edge_index, edge_attr = processor_graph(N, args.k)
        torch.manual_seed(1234)
        model = GNNProcessor(
            num_layers=args.layers, num_channels=C, num_chunks=args.chunks, mlp_extra_layers=args.mlp_extra_layers,
            edge_dim=edge_attr.shape[1], mlp_hidden_ratio=1.0, layer_kernels=kernels,
            gradient_checkpointing=bool(args.ckpt),
        )
        x_full = torch.randn(N, C, generator=gen)
        g_full = torch.randn(N, C, generator=gen)
        sizes = get_balanced_partition_sizes(N, world)
        s, e = get_partition_range(sizes, rank)
        x = x_full[s:e].clone().requires_grad_(True)
        g = g_full[s:e].clone()
        shard_info = GraphShardInfo(nodes=sizes, edges=None)  # edges replicated; the processor shards them 1-hop

        def fwd():
            return model(x, batch_size=1, shard_info=shard_info, edge_attr=edge_attr, edge_index=edge_index,
                         model_comm_group=mgroup)

        inputs, in_sizes, out_sizes = [x], [sizes], sizes
        cfg = f"gnnproc_N{N}_E{edge_index.shape[1]}_C{C}_L{args.layers}_x{args.mlp_extra_layers}_ck{args.ckpt}"
        shape = {"nodes": N, "edges": int(edge_index.shape[1]), "channels": C, "layers": args.layers,
                 "num_chunks": args.chunks, "grad_ckpt": args.ckpt, "edge_dim": 4,
                 "mlp_extra_layers": args.mlp_extra_layers, "mlp_hidden_ratio": 1.0}
    else:
        Nd, Nh = args.data_nodes, args.nodes
        edge_index, edge_attr = encoder_graph(Nd, Nh, args.k_enc)
        torch.manual_seed(1234)
        model = GNNForwardMapper(
            in_channels_src=args.in_src, in_channels_dst=args.in_dst, num_channels=C, num_chunks=args.chunks,
            mlp_extra_layers=args.mlp_extra_layers, edge_dim=edge_attr.shape[1], mlp_hidden_ratio=1.0,
            layer_kernels=kernels, gradient_checkpointing=bool(args.ckpt),
        )
        model.proc.update_src_nodes = bool(args.update_src_nodes)
        xs_full = torch.randn(Nd, args.in_src, generator=gen)
        xd_full = torch.randn(Nh, args.in_dst, generator=gen)
        g_full = torch.randn(Nh, C, generator=gen)
        src_sizes = get_balanced_partition_sizes(Nd, world)
        dst_sizes = get_balanced_partition_sizes(Nh, world)
        s0, e0 = get_partition_range(src_sizes, rank)
        s1, e1 = get_partition_range(dst_sizes, rank)
        xs = xs_full[s0:e0].clone().requires_grad_(True)
        xd = xd_full[s1:e1].clone().requires_grad_(True)
        g = g_full[s1:e1].clone()
        # as bench_graphtransformer's G2: data and hidden nodes sharded, edges not yet (sharded 1-hop inside)
        shard_info = BipartiteGraphShardInfo(src_nodes=src_sizes, dst_nodes=dst_sizes, edges=None)

        def fwd():
            _, x_lat = model((xs, xd), batch_size=1, shard_info=shard_info, edge_attr=edge_attr,
                             edge_index=edge_index, model_comm_group=mgroup, keep_x_dst_sharded=True)
            return x_lat

        inputs, in_sizes, out_sizes = [xs, xd], [src_sizes, dst_sizes], dst_sizes
        cfg = (f"gnnenc_Nd{Nd}_Nh{Nh}_E{edge_index.shape[1]}_C{C}_x{args.mlp_extra_layers}"
               f"_us{args.update_src_nodes}_ck{args.ckpt}")
        shape = {"data_nodes": Nd, "hidden_nodes": Nh, "edges": int(edge_index.shape[1]), "channels": C,
                 "in_src": args.in_src, "in_dst": args.in_dst, "num_chunks": args.chunks, "grad_ckpt": args.ckpt,
                 "edge_dim": 4, "mlp_extra_layers": args.mlp_extra_layers, "mlp_hidden_ratio": 1.0,
                 "update_src_nodes": bool(args.update_src_nodes)}

    ref_path = os.path.join(os.environ.get("ANEMOI_ENV", "/tmp/anemoi-env"), "bench_ref", f"{cfg}.pt")
    rss_setup = rss_mib()
    state = {}

    def step():
        model.zero_grad(set_to_none=True)
        for t in inputs:
            t.grad = None
        t0 = now()
        out = fwd()
        t1 = now()
        (out * g).sum().backward()
        t2 = now()
        state["out"] = out.detach()
        return t1 - t0, t2 - t1

    COMM["s"], COMM["calls"] = 0.0, 0
    times = timed_steps(step, args.warmup, args.steps, group)
    n_all = args.warmup + args.steps
    comm_per_step, comm_calls = COMM["s"] / n_all, COMM["calls"] / n_all
    peak = peak_rss_mib()

    out_full = gather_tensor(state["out"], 0, out_sizes, mgroup) if world > 1 else state["out"]
    in_grads = [gather_tensor(t.grad, 0, sz, mgroup) if world > 1 else t.grad for t, sz in zip(inputs, in_sizes, strict=True)]
    grads = {}
    for name, prm in model.named_parameters():
        if prm.grad is None:
            continue
        gr = prm.grad.detach().clone()
        if world > 1:
            dist.all_reduce(gr, group=group)
        grads[name] = gr

    summ = times.summary()
    per_rank = all_gather_obj(
        {"rank": rank, "times": summ, "peak_rss_mib": peak, "rss_setup_mib": rss_setup, "rss_start_mib": rss0,
         "comm_s_per_step": comm_per_step, "comm_calls_per_step": comm_calls},
        mgroup,
    )
    result = {
        "bench": "GNNProcessor" if args.component == "processor" else "GNNForwardMapper",
        "anemoi_models": anemoi.models.__version__, "torch": torch.__version__, "world": world,
        "threads_per_rank": args.threads, "strategy": "edges" if world > 1 else "single",
        "backend": "pyg", "shape": shape, "params": sum(p_.numel() for p_ in model.parameters()),
        "median_fwd_bwd_s_max_over_ranks": max_over_ranks(summ["total"], mgroup),
        "min_fwd_bwd_s_max_over_ranks": max_over_ranks(summ["min_total"], mgroup),
        "median_cpu_s_sum_over_ranks": sum(r["times"]["cpu"] for r in per_rank),
        "per_rank": per_rank,
    }
    if world == 1 and args.save_ref:
        os.makedirs(os.path.dirname(ref_path), exist_ok=True)
        torch.save({"out": out_full, "in_grads": in_grads, "grads": grads}, ref_path)
    if rank == 0 and os.path.exists(ref_path):
        ref = torch.load(ref_path)
        result["vs_single"] = {
            "out_rel_err": rel_err(out_full, ref["out"]),
            "input_grad_rel_err": max(rel_err(a, b) for a, b in zip(in_grads, ref["in_grads"], strict=True)),
            **param_grad_errors(grads, ref["grads"]),
        }
    if rank == 0:
        name = f"{cfg}_{result['strategy']}_w{world}_t{args.threads}.json"
        write_json(os.path.join(os.environ.get("ANEMOI_BENCH_OUT", "anemoi-bench-results"), name), result)
        print(f"RESULT {name}: median fwd+bwd {result['median_fwd_bwd_s_max_over_ranks']:.3f}s "
              f"(min {result['min_fwd_bwd_s_max_over_ranks']:.3f}s, cpu-s {result['median_cpu_s_sum_over_ranks']:.2f}, "
              f"load {per_rank[0]['times']['loadavg_1m']:.1f}) "
              f"peak_rss {[round(r['peak_rss_mib']) for r in per_rank]} MiB "
              f"comm/step {[round(r['comm_s_per_step'], 3) for r in per_rank]}s "
              f"params {result['params']} vs_single {result.get('vs_single')}", flush=True)
    if world > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
