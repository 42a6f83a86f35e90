"""stormshard's graph-transformer (G1, G2) and GNN (N1, N2) processor and encoder against anemoi-models, same shapes.

The stormshard side of ``../shared/anemoi-bench`` (issue 14): the same synthetic graphs (Fibonacci
lattices ordered north to south, symmetric kNN processor graph, data -> k nearest hidden encoder
graph, edge attributes length/dx/dy/dz; re-implemented here), the same float32 random inputs and
output gradient, the same timing (one warm-up step, then the median of the timed forward +
backward steps, the maximum over ranks; a barrier before every step) and the same memory
accounting (peak RSS of each rank's process, ``ru_maxrss``). Two ranks: gloo, destination-node
sharding with stormshard's halo plan (the normed source rows cross one ``all_to_all_single``).

G1: ``--component processor`` (16 GraphTransformerProcessorBlocks, 4,096 nodes, k=8, C 256, 8 heads).
G2: ``--component mapper`` (16,384 data nodes -> 4,096 hidden, 4 hidden neighbours per data node,
96 source / 16 destination input channels embedded to C 256 by linears, one
GraphTransformerMapperBlock), as anemoi's ``GraphTransformerForwardMapper``. Both graph-transformer
cases build stormshard's blocks with ``self_projection=True`` (anemoi's ``lin_self``), so that the
two sides have the same parameters and the same dense work (the printed parameter counts agree).

N1: ``--component gnn_processor`` (16 GNNProcessorBlocks on G1's graph, C 256, edges C wide: the
first block embeds the 4 edge attributes), as anemoi's ``GNNProcessor``. N2: ``--component
gnn_mapper`` (G2's graph and inputs; source / destination node MLP embeddings 96 / 16 -> C 256 and
one GNNMapperBlock that embeds the edges), as anemoi's ``GNNForwardMapper``. Architecture parity
with anemoi's AIFS GNN defaults (``mlp_extra_layers`` 0, ``mlp_hidden_ratio`` 1): every MLP is
Linear, GELU, Linear, GELU, Linear, LayerNorm (``mlp_hidden_layers = --mlp-extra-layers + 2``),
edge features are C wide after an MLP embedding of the raw attributes (``edge_in_channels=4``),
the aggregation sums the updated edges (``aggregate_updated_edges=True``), hidden widths C; both
sides print their parameter counts, which must be equal. anemoi's forward mapper also updates the
data nodes (``update_src_nodes``, its default), computed in the forward but not back-propagated
here (the loss is on the hidden nodes, as in G2); ``--src-update 1`` (the default) computes the
same update on stormshard's side (the block's node MLP on ``[x_src, x_src]``), ``0`` switches it
off on both sides. anemoi's side is ``benchmarks/anemoi_side/bench_gnn.py`` (run with anemoi's
interpreter; it reuses the anemoi-bench graph builders and timing helpers).

    python benchmarks/bench_graph_vs_anemoi.py --component processor            # 1 process
    torchrun --standalone --nproc_per_node 2 benchmarks/bench_graph_vs_anemoi.py --component processor
    python benchmarks/bench_graph_vs_anemoi.py --compare [--layers 4] [--repeat 2] [--floor]
    python benchmarks/bench_graph_vs_anemoi.py --compare --cases N1,N2 [--worlds 1,2]

``--compare`` runs, for each case of ``--cases`` (default G1, G2, N1, N2) at 1 and 2 processes,
anemoi's script (``$ANEMOI_BENCH/bench_graphtransformer.py`` for G1/G2,
``benchmarks/anemoi_side/bench_gnn.py`` for N1/N2, with ``$ANEMOI_PY`` and ``$ANEMOI_PYTHONPATH``, or
``--anemoi-bench``, ``--anemoi-python``, ``--anemoi-pythonpath``; defaults ``/work/shared/anemoi-bench``,
``/tmp/anemoi-env/venv/bin/python`` and no PYTHONPATH) and this one back to back
(``--repeat`` pairs, alternating), and prints the medians and the ratios: speed-up = anemoi time /
stormshard time, memory = stormshard peak RSS / anemoi peak RSS (max over ranks); also the
ratio of process CPU seconds per step (summed over ranks), which a loaded machine disturbs less. Absolute times
vary between machines and hours; only ratios from one run mean anything.

Every stormshard run also times its dense matrix products (``mm``/``addmm``/``bmm`` forward and
backward, :mod:`gemm_timer`) on two extra, untimed steps; ``--compare`` prints, per row, that
dense-product time (max over ranks), the rest of stormshard's step, the rest a 1.5x speed-up
would allow, and the speed-up ceiling ``anemoi time / stormshard dense-product time``: the
largest speed-up any implementation doing these dense products could show on this machine.
``--floor`` adds anemoi's dense FLOPs and dense-product time per rank (one more, untimed anemoi run
per row under ``anemoi_side/gemm_floor.py``).

``--chunks`` is each library's own edge-chunk setting: anemoi's README commands use 2 for G1 and
1 for G2 (anemoi loops over chunks without checkpointing); stormshard's default here is 1
(``--st-chunks``), its fused attention keeps no per-edge feature tensors, and ``num_chunks > 1``
in stormshard means checkpointed chunks (lower memory, a recomputed forward). For N1 anemoi's
``num_chunks`` is the AIFS processor's 2 (layer groups for checkpointing, inert with ``--ckpt 0``),
for N2 the AIFS encoder's 1 (edge chunks).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gemm_timer import DenseGemmTimer, peak_gemm_rate  # noqa: E402

from stormshard.layers.gnn import EdgeBufferPool, GNNMapperBlock, GNNProcessorBlock, gnn_mlp  # noqa: E402
from stormshard.layers.graph_transformer import (  # noqa: E402
    GraphTransformerMapperBlock,
    GraphTransformerProcessorBlock,
)
from stormshard.parallel.counter import CommCounter  # noqa: E402
from stormshard.parallel.graph import GraphShardPlan  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


# --------------------------------------------------------------------------------------------
# graphs (same definitions as the anemoi benchmark: Fibonacci lattice, kNN, edge attributes)
# --------------------------------------------------------------------------------------------


def fibonacci_sphere(n: int) -> np.ndarray:
    """``(n, 3)`` unit vectors of a Fibonacci lattice, point ``i`` at ``z = 1 - (2i + 1) / n``
    (north to south), longitude advancing by the golden angle."""
    idx = np.arange(n, dtype=np.float64) + 0.5
    z = 1.0 - 2.0 * idx / n
    rho = np.sqrt(1.0 - z * z)
    lon = idx * math.pi * (3.0 - math.sqrt(5.0))
    return np.column_stack([rho * np.cos(lon), rho * np.sin(lon), z])


def _edges(src_xyz: np.ndarray, dst_xyz: np.ndarray, src: np.ndarray, dst: np.ndarray):
    """``edge_index`` (2, E) ordered by (destination, source) and ``edge_attr`` (E, 4): the edge
    vector's length and its x, y, z components (source minus destination)."""
    order = np.lexsort((src, dst))
    src, dst = src[order], dst[order]
    vec = src_xyz[src] - dst_xyz[dst]
    attr = np.column_stack([np.linalg.norm(vec, axis=1), vec])
    return torch.from_numpy(np.stack([src, dst]).astype(np.int64)), torch.from_numpy(attr).float()


def knn_processor_graph(n: int, k: int):
    """Symmetric kNN graph on an ``n``-point lattice (an edge both ways for every kNN pair)."""
    from scipy.spatial import cKDTree

    xyz = fibonacci_sphere(n)
    _, nbr = cKDTree(xyz).query(xyz, k=k + 1)  # first neighbour is the node itself
    a = nbr[:, 1:].reshape(-1)
    b = np.repeat(np.arange(n), k)
    pairs = np.unique(np.concatenate([np.column_stack([a, b]), np.column_stack([b, a])]), axis=0)
    return _edges(xyz, xyz, pairs[:, 0], pairs[:, 1])


def knn_encoder_graph(n_data: int, n_hidden: int, k: int):
    """Every data node -> its ``k`` nearest hidden nodes."""
    from scipy.spatial import cKDTree

    data, hidden = fibonacci_sphere(n_data), fibonacci_sphere(n_hidden)
    _, nbr = cKDTree(hidden).query(data, k=k)
    return _edges(data, hidden, np.repeat(np.arange(n_data), k), nbr.reshape(-1))


# --------------------------------------------------------------------------------------------
# one run (1 process, or one rank under torchrun)
# --------------------------------------------------------------------------------------------


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _max_over_ranks(value: float, group) -> float:  # noqa: ANN001
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def _sum_over_ranks(value: float, group) -> float:  # noqa: ANN001
    if group is None:
        return value
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, group=group)
    return float(t.item())


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
        group = dist.group.WORLD
        rank, world = dist.get_rank(), dist.get_world_size()
    else:
        group, rank, world = None, 0, 1
    gen = torch.Generator().manual_seed(42)
    c = args.channels

    processor = args.component in ("processor", "gnn_processor")
    if processor:  # one node set: G1's graph, sharded node features in and out
        n = args.nodes
        edge_index, edge_attr = knn_processor_graph(n, args.k)
        plan = GraphShardPlan.build(edge_index, n, group)
        x = plan.shard_src(torch.randn(n, c, generator=gen)).clone().requires_grad_(True)
        grad_out = plan.shard_dst(torch.randn(n, c, generator=gen)).clone()
        inputs = [x]
        shape = dict(nodes=n, edges=int(edge_index.shape[1]), channels=c, layers=args.layers)
    else:  # encoder: G2's graph, data -> hidden
        nd, nh = args.data_nodes, args.nodes
        edge_index, edge_attr = knn_encoder_graph(nd, nh, args.k_enc)
        plan = GraphShardPlan.build(edge_index, (nd, nh), group)
        xs = plan.shard_src(torch.randn(nd, args.in_src, generator=gen)).clone().requires_grad_(True)
        xd = plan.shard_dst(torch.randn(nh, args.in_dst, generator=gen)).clone().requires_grad_(True)
        grad_out = plan.shard_dst(torch.randn(nh, c, generator=gen)).clone()
        inputs = [xs, xd]
        shape = dict(data_nodes=nd, hidden_nodes=nh, edges=int(edge_index.shape[1]), channels=c,
                     in_src=args.in_src, in_dst=args.in_dst)
    attr = plan.shard_edges(edge_attr)
    gnn_shape = dict(edge_dim=4, mlp_extra_layers=args.mlp_extra_layers, mlp_hidden_ratio=1.0)
    hidden_layers = args.mlp_extra_layers + 2  # anemoi's MLP depth with mlp_extra_layers
    pool = EdgeBufferPool()  # one pool for every GNN block and MLP, as the models do
    torch.manual_seed(1234)

    if processor:
        if args.component == "processor":
            blocks = torch.nn.ModuleList(
                GraphTransformerProcessorBlock(c, edge_attr.shape[1], args.heads, plan, mlp_ratio=4.0,
                                               num_chunks=args.st_chunks, self_projection=True)
                for _ in range(args.layers)
            )
            shape.update(heads=args.heads)
        else:  # anemoi's GNNProcessor: edges C wide, the first layer embeds the raw attributes (edge_dim)
            blocks = torch.nn.ModuleList(
                GNNProcessorBlock(c, c, plan, mlp_ratio=1.0, num_chunks=args.st_chunks, buffer_pool=pool,
                                  mlp_hidden_layers=hidden_layers, aggregate_updated_edges=True,
                                  edge_in_channels=edge_attr.shape[1] if i == 0 else None)
                for i in range(args.layers)
            )
            shape.update(gnn_shape)
        params = list(blocks.parameters())

        def forward() -> torch.Tensor:
            y, e = x, attr  # the graph transformer returns its edges unchanged, the GNN updates them
            for block in blocks:
                y, e = block(y, e)
            return y

    elif args.component == "gnn_mapper":
        # anemoi's GNNForwardMapper: MLP embeddings of the nodes and (in the block) of the edges
        embed_src = gnn_mlp(args.in_src, c, c, hidden_layers, buffer_pool=pool)
        embed_dst = gnn_mlp(args.in_dst, c, c, hidden_layers, buffer_pool=pool)
        block = GNNMapperBlock(c, c, c, plan, mlp_ratio=1.0, num_chunks=args.st_chunks, buffer_pool=pool,
                               mlp_hidden_layers=hidden_layers, edge_in_channels=edge_attr.shape[1],
                               aggregate_updated_edges=True)
        params = [*embed_src.parameters(), *embed_dst.parameters(), *block.parameters()]
        shape.update(gnn_shape, src_update=bool(args.src_update))

        def forward() -> torch.Tensor:
            h_src = embed_src(xs)
            out = block(h_src, embed_dst(xd), attr)
            if args.src_update:  # anemoi's update_src_nodes: computed, not back-propagated (as on anemoi's side)
                h_src + block.node_mlp(torch.cat([h_src, h_src], dim=-1))
            return out

    else:
        embed_src, embed_dst = torch.nn.Linear(args.in_src, c), torch.nn.Linear(args.in_dst, c)
        block = GraphTransformerMapperBlock(c, c, edge_attr.shape[1], args.heads, plan, mlp_ratio=4.0,
                                            num_chunks=args.st_chunks, self_projection=True)
        params = [*embed_src.parameters(), *embed_dst.parameters(), *block.parameters()]
        shape.update(heads=args.heads)

        def forward() -> torch.Tensor:
            return block(embed_src(xs), embed_dst(xd), attr)

    def step() -> tuple[float, float]:
        for t in [*params, *inputs]:
            t.grad = None
        t0 = time.perf_counter()
        out = forward()
        t1 = time.perf_counter()
        (out * grad_out).sum().backward()
        return t1 - t0, time.perf_counter() - t1

    rss_setup = _peak_rss_mib()
    totals, fwds, cpus = [], [], []
    for i in range(args.warmup + args.steps):
        if group is not None:
            dist.barrier(group)
        if i == args.warmup:
            counter = CommCounter().__enter__()
        c0 = time.process_time()
        f, b = step()
        c = time.process_time() - c0
        if i >= args.warmup:
            totals.append(f + b)
            fwds.append(f)
            cpus.append(c)
    counter.__exit__(None, None, None)
    peak = _peak_rss_mib()
    # two more steps with the dense products timed, the second counted (not timed steps: the
    # dispatch adds overhead, and the first step under it runs slower)
    for _ in range(2):
        if group is not None:
            dist.barrier(group)
        with DenseGemmTimer() as gemm:
            step()
    median = statistics.median(totals)
    result = dict(
        component=args.component, world=world, threads_per_rank=args.threads, shape=shape,
        stormshard_chunks=args.st_chunks, torch=torch.__version__, params=sum(t.numel() for t in params),
        median_fwd_bwd_s_max_over_ranks=_max_over_ranks(median, group),
        median_fwd_s_max_over_ranks=_max_over_ranks(statistics.median(fwds), group),
        median_cpu_s_sum_over_ranks=_sum_over_ranks(statistics.median(cpus), group),
        gemm_s_per_step_max_over_ranks=_max_over_ranks(gemm.seconds, group),
        gemm_flops_per_step_max_over_ranks=_max_over_ranks(float(gemm.flops), group),
        peak_rss_mib=[_peak_rss_mib()], rss_setup_mib=rss_setup, halo_rows=[plan.num_halo], edges_local=[plan.num_edges_local],
        comm_bytes_per_step=[counter.total_bytes / max(1, len(totals))],
    )
    if group is not None:
        gathered = [None] * world
        dist.all_gather_object(gathered, (peak, plan.num_halo, plan.num_edges_local,
                                          counter.total_bytes / max(1, len(totals))), group=group)
        result["peak_rss_mib"] = [g[0] for g in gathered]
        result["halo_rows"] = [g[1] for g in gathered]
        result["edges_local"] = [g[2] for g in gathered]
        result["comm_bytes_per_step"] = [g[3] for g in gathered]
    if rank == 0:
        print(f"RESULT stormshard {args.component} world {world}: median fwd+bwd "
              f"{result['median_fwd_bwd_s_max_over_ranks']:.3f}s (fwd {result['median_fwd_s_max_over_ranks']:.3f}s, "
              f"cpu-s {result['median_cpu_s_sum_over_ranks']:.2f}, load {os.getloadavg()[0]:.1f}) "
              f"peak_rss {[round(p) for p in result['peak_rss_mib']]} MiB (after setup {rss_setup:.0f}) halo rows {result['halo_rows']} "
              f"comm bytes/step {[int(b) for b in result['comm_bytes_per_step']]} params {result['params']}; "
              f"dense products {result['gemm_s_per_step_max_over_ranks']:.3f}s "
              f"({result['gemm_flops_per_step_max_over_ranks'] / 1e9:.1f} GFLOP, max over ranks)",
              flush=True)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(result, fh, indent=2)
    if group is not None:
        dist.destroy_process_group()
    return result


# --------------------------------------------------------------------------------------------
# --compare: anemoi and stormshard back to back
# --------------------------------------------------------------------------------------------

CASES = {
    "G1": dict(component="processor", anemoi_chunks=2, steps=3),
    "G2": dict(component="mapper", anemoi_chunks=1, steps=5),
    "N1": dict(component="gnn_processor", anemoi_chunks=2, steps=3),
    "N2": dict(component="gnn_mapper", anemoi_chunks=1, steps=5),
}
COMPONENT_CASE = {case["component"]: name for name, case in CASES.items()}
GNN_SCRIPT = os.path.join(HERE, "anemoi_side", "bench_gnn.py")
FLOOR_SCRIPT = os.path.join(HERE, "anemoi_side", "gemm_floor.py")


def _shape_args(args: argparse.Namespace, component: str, anemoi: bool = False) -> list[str]:
    """The shape arguments of ``component``, for this script or (``anemoi``) for anemoi's script,
    whose ``--component`` is ``processor`` / ``mapper`` (bench_gnn.py has no ``--heads``)."""
    gnn = component.startswith("gnn_")
    common = ["--nodes", str(args.nodes), "--channels", str(args.channels), "--threads", str(args.threads),
              "--warmup", str(args.warmup)]
    if not gnn:
        common += ["--heads", str(args.heads)]
    kind = component.removeprefix("gnn_")
    if gnn:
        common += ["--mlp-extra-layers", str(args.mlp_extra_layers)]
    if kind == "mapper" and gnn:
        common += ["--update-src-nodes" if anemoi else "--src-update", str(args.src_update)]
    name = kind if anemoi else component
    if kind == "processor":
        return common + ["--component", name, "--k", str(args.k), "--layers", str(args.layers)]
    return common + ["--component", name, "--data-nodes", str(args.data_nodes), "--k-enc", str(args.k_enc),
                     "--in-src", str(args.in_src), "--in-dst", str(args.in_dst)]


def _launch(python: str, script: list[str], world: int) -> list[str]:
    if world == 1:
        return [python, *script]
    return [python, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world), *script]


def _check_run(command: list[str], env: dict, what: str) -> None:
    """Run ``command``; a RuntimeError with the tail of its output if it fails."""
    proc = subprocess.run(command, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def _anemoi_command(args, case: dict, world: int, steps: int, out_dir: str, floor_dir: str | None = None):  # noqa: ANN001, ANN202
    """anemoi's script for ``case`` (under ``anemoi_side/gemm_floor.py`` when ``floor_dir``) and its environment."""
    gnn = case["component"].startswith("gnn_")
    path = GNN_SCRIPT if gnn else os.path.join(args.anemoi_bench, "bench_graphtransformer.py")
    script = [path, *_shape_args(args, case["component"], anemoi=True),
              "--chunks", str(case["anemoi_chunks"]), "--ckpt", "0", "--steps", str(steps)]
    if floor_dir is not None:
        script = [FLOOR_SCRIPT, floor_dir, *script]
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads), ANEMOI_BENCH_OUT=out_dir,
               ANEMOI_BENCH=os.path.abspath(args.anemoi_bench))
    env.pop("PYTHONPATH", None)
    if args.anemoi_pythonpath:  # e.g. a --target install of anemoi-models and its dependencies
        env["PYTHONPATH"] = args.anemoi_pythonpath
    return _launch(args.anemoi_python, script, world), env


def _run_anemoi(args, case: dict, world: int, steps: int, out_dir: str) -> dict:  # noqa: ANN001
    shutil.rmtree(out_dir, ignore_errors=True)
    command, env = _anemoi_command(args, case, world, steps, out_dir)
    _check_run(command, env, "anemoi run")
    (name,) = [f for f in os.listdir(out_dir) if f.endswith(".json")]
    with open(os.path.join(out_dir, name)) as fh:
        res = json.load(fh)
    return dict(time=res["median_fwd_bwd_s_max_over_ranks"], cpu=res["median_cpu_s_sum_over_ranks"],
                rss=max(r["peak_rss_mib"] for r in res["per_rank"]), params=res.get("params"))


def _anemoi_dense_products(args, case: dict, world: int, out_dir: str) -> dict:  # noqa: ANN001
    """anemoi's dense products per step (seconds and FLOPs, max over ranks), from one untimed run
    (one warm-up and one step, the second counted) under ``anemoi_side/gemm_floor.py``."""
    floor_dir = os.path.join(out_dir, "floor")
    shutil.rmtree(out_dir, ignore_errors=True)
    command, env = _anemoi_command(args, case, world, 1, out_dir, floor_dir)
    _check_run(command, env, "anemoi dense-product run")
    ranks = []
    for name in sorted(os.listdir(floor_dir)):
        with open(os.path.join(floor_dir, name)) as fh:
            ranks.append(json.load(fh))
    return dict(gemm_s=max(r["gemm_s_per_step"] for r in ranks), gemm_flops=max(r["gemm_flops_per_step"] for r in ranks))


def _run_ours(args, case: dict, world: int, steps: int, out_json: str) -> dict:  # noqa: ANN001
    script = [os.path.abspath(__file__), *_shape_args(args, case["component"]), "--st-chunks", str(args.st_chunks),
              "--steps", str(steps), "--json", out_json]
    root = os.path.dirname(HERE)
    env = dict(os.environ, OMP_NUM_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    _check_run(_launch(sys.executable, script, world), env, "stormshard run")
    with open(out_json) as fh:
        res = json.load(fh)
    return dict(time=res["median_fwd_bwd_s_max_over_ranks"], cpu=res["median_cpu_s_sum_over_ranks"],
                rss=max(res["peak_rss_mib"]), params=res["params"],
                halo=res["comm_bytes_per_step"], gemm_s=res["gemm_s_per_step_max_over_ranks"],
                gemm_flops=res["gemm_flops_per_step_max_over_ranks"])


def compare(args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="bench_graph_vs_anemoi_")
    rows, floors = [], []
    cases = [c.strip() for c in args.cases.split(",")]
    worlds = [int(w) for w in args.worlds.split(",")]
    print(f"machine: {os.cpu_count()} CPU(s), {args.threads} thread(s) per rank, load {os.getloadavg()[0]:.1f}; "
          f"torch {torch.__version__}; G1/N1 layers {args.layers}; stormshard num_chunks {args.st_chunks}; "
          f"GNN mlp_extra_layers {args.mlp_extra_layers}, N2 source update {bool(args.src_update)}", flush=True)
    for name in cases:
        case = CASES[name]
        steps = args.steps if args.steps is not None else case["steps"]
        for world in worlds:
            an, st = [], []
            for r in range(args.repeat):
                order = (("anemoi", "stormshard") if r % 2 == 0 else ("stormshard", "anemoi"))
                for who in order:
                    if who == "anemoi":
                        an.append(_run_anemoi(args, case, world, steps, os.path.join(tmp, "anemoi")))
                    else:
                        st.append(_run_ours(args, case, world, steps, os.path.join(tmp, "ours.json")))
                print(f"  {name} world {world} pair {r + 1}: anemoi {an[-1]['time']:.3f}s {an[-1]['rss']:.0f} MiB | "
                      f"stormshard {st[-1]['time']:.3f}s {st[-1]['rss']:.0f} MiB | speed-up "
                      f"{an[-1]['time'] / st[-1]['time']:.2f}x (cpu-s {an[-1]['cpu']:.2f} vs {st[-1]['cpu']:.2f}: "
                      f"{an[-1]['cpu'] / st[-1]['cpu']:.2f}x), memory {st[-1]['rss'] / an[-1]['rss']:.2f}x; "
                      f"params anemoi {an[-1]['params']} stormshard {st[-1]['params']}", flush=True)
            speed = statistics.median(a["time"] / s["time"] for a, s in zip(an, st, strict=True))
            mem = statistics.median(s["rss"] / a["rss"] for a, s in zip(an, st, strict=True))
            cpu = statistics.median(a["cpu"] / s["cpu"] for a, s in zip(an, st, strict=True))
            rows.append((name, world, statistics.median(a["time"] for a in an), statistics.median(s["time"] for s in st),
                         speed, statistics.median(a["rss"] for a in an), statistics.median(s["rss"] for s in st), mem,
                         st[-1]["halo"], cpu, an[-1]["params"], st[-1]["params"]))
            floors.append(dict(
                name=name, world=world, anemoi_time=rows[-1][2], time=rows[-1][3],
                gemm_s=statistics.median(s["gemm_s"] for s in st), gemm_flops=st[-1]["gemm_flops"],
                anemoi=_anemoi_dense_products(args, case, world, os.path.join(tmp, "anemoi")) if args.floor else None,
            ))
    print("\n| case | processes | anemoi s | stormshard s | speed-up | anemoi peak RSS MiB/rank | "
          "stormshard peak RSS MiB/rank | memory ratio | cpu-s speed-up | stormshard halo bytes/step per rank | "
          "params anemoi / stormshard |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, world, ta, ts, sp, ra, rs, mr, halo, cpu, pa, ps in rows:
        print(f"| {name} | {world} | {ta:.3f} | {ts:.3f} | {sp:.2f}x | {ra:.0f} | {rs:.0f} | {mr:.2f}x | {cpu:.2f}x | "
              f"{[int(h) for h in halo]} | {pa} / {ps} |")
    goal = all(r[4] >= 1.5 and r[7] <= 0.7 for r in rows)
    print(f"\ngoal (speed-up >= 1.5x and memory <= 0.7x in every row): {'met' if goal else 'NOT met'}")
    torch.set_num_threads(args.threads)
    _print_floors(floors, peak_gemm_rate())
    shutil.rmtree(tmp, ignore_errors=True)


def _print_floors(floors: list[dict], peak: float) -> None:
    """The dense-product floor of each row (:mod:`gemm_timer`): what stormshard's step spends in dense
    matrix products (median over its runs, max over ranks), the rest of its step, how much rest a
    1.5x speed-up allows, and the largest speed-up an implementation of the same dense products
    could reach: anemoi's time / stormshard's dense-product time, and anemoi's time / (the dense
    FLOPs at the ``peak`` rate of a linear layer's products measured in this process)."""
    print(f"\npeak rate of a linear layer's products here (2048 x 256 -> 1024, fwd + both gradients): {peak:.1f} GFLOP/s")
    print("\n| case | processes | stormshard dense GFLOP/rank | stormshard dense-product s | anemoi dense GFLOP/rank | "
          "anemoi dense-product s | stormshard other s (step - dense) | other s allowed at 1.5x | speed-up ceiling | "
          "ceiling at peak rate |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for f in floors:
        an = f["anemoi"]
        an_flops, an_s = ("-", "-") if an is None else (f"{an['gemm_flops'] / 1e9:.1f}", f"{an['gemm_s']:.3f}")
        at_peak = f["gemm_flops"] / 1e9 / peak
        print(f"| {f['name']} | {f['world']} | {f['gemm_flops'] / 1e9:.1f} | {f['gemm_s']:.3f} | {an_flops} | {an_s} | "
              f"{f['time'] - f['gemm_s']:.3f} | {f['anemoi_time'] / 1.5 - f['gemm_s']:.3f} | "
              f"{f['anemoi_time'] / f['gemm_s']:.2f}x | {f['anemoi_time'] / at_peak:.2f}x |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--component", default="processor", choices=list(COMPONENT_CASE))
    p.add_argument("--nodes", type=int, default=4096, help="hidden mesh nodes")
    p.add_argument("--data-nodes", type=int, default=16384, help="data grid nodes (mapper)")
    p.add_argument("--k", type=int, default=8, help="kNN of the processor graph (before symmetrisation)")
    p.add_argument("--k-enc", type=int, default=4, help="hidden neighbours per data node (mapper)")
    p.add_argument("--channels", type=int, default=256)
    p.add_argument("--in-src", type=int, default=96)
    p.add_argument("--in-dst", type=int, default=16)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--st-chunks", type=int, default=1, help="stormshard num_chunks")
    p.add_argument("--mlp-extra-layers", type=int, default=0,
                   help="GNN (N1, N2): anemoi's mlp_extra_layers (AIFS: 0); stormshard mlp_hidden_layers = this + 2")
    p.add_argument("--src-update", type=int, default=1, choices=[0, 1],
                   help="N2: update the data nodes as anemoi's GNNForwardMapper (forward only; both sides)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=None,
                   help="timed steps (default: G1/N1 3, G2/N2 5, as anemoi's README)")
    p.add_argument("--json", default=None, help="write the result here (rank 0)")
    p.add_argument("--compare", action="store_true", help="run anemoi's and this benchmark back to back")
    p.add_argument("--quick", action="store_true",
                   help="small shapes (512 hidden / 2,048 data nodes, 64 channels, 2 layers, 1 step; make bench)")
    p.add_argument("--cases", default="G1,G2,N1,N2")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--repeat", type=int, default=1, help="--compare: pairs per case (alternating order)")
    p.add_argument("--floor", action="store_true",
                   help="--compare: also time anemoi's dense matrix products (one more, untimed anemoi run per row)")
    p.add_argument("--anemoi-python", default=os.environ.get("ANEMOI_PY", "/tmp/anemoi-env/venv/bin/python"),
                   help="--compare: interpreter for anemoi's script (env ANEMOI_PY)")
    p.add_argument("--anemoi-bench", default=os.environ.get("ANEMOI_BENCH", "/work/shared/anemoi-bench"),
                   help="--compare: folder holding bench_graphtransformer.py and common.py (env ANEMOI_BENCH)")
    p.add_argument("--anemoi-pythonpath", default=os.environ.get("ANEMOI_PYTHONPATH", ""),
                   help="--compare: PYTHONPATH for anemoi's runs (env ANEMOI_PYTHONPATH; default: none)")
    args = p.parse_args()
    if args.quick:
        args.nodes, args.data_nodes, args.channels, args.layers, args.heads = 512, 2048, 64, 2, 4
        args.in_src, args.in_dst, args.steps = 16, 8, args.steps or 1
    if args.compare:
        compare(args)
        return
    if args.steps is None:
        args.steps = CASES[COMPONENT_CASE[args.component]]["steps"]
    run(args)


if __name__ == "__main__":
    main()
