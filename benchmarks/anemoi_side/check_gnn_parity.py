"""Architecture parity of the N1 / N2 GNN comparison: anemoi's GNNProcessor and GNNForwardMapper and
stormshard's GNN blocks as ``bench_graph_vs_anemoi.py`` builds them compute the same function.

Copies anemoi's weights into stormshard's blocks (small graphs from anemoi-bench's builders, float64)
and checks equal parameter counts and outputs. Run with anemoi's interpreter and the repository
root on the path (stormshard's own dependencies are a subset of that venv's)::

    PYTHONPATH=. /tmp/anemoi-env/venv/bin/python benchmarks/anemoi_side/check_gnn_parity.py

The anemoi-bench folder comes from ``--anemoi-bench`` or ``$ANEMOI_BENCH`` (default
``/work/shared/anemoi-bench``), as in ``bench_gnn.py``.
"""

from __future__ import annotations

import argparse
import os
import sys

p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
p.add_argument("--anemoi-bench", default=os.environ.get("ANEMOI_BENCH", "/work/shared/anemoi-bench"))
p.add_argument("--channels", type=int, default=16)
p.add_argument("--mlp-extra-layers", type=int, default=0)
ARGS = p.parse_args()
sys.path.insert(0, os.path.abspath(ARGS.anemoi_bench))

import torch  # noqa: E402
from anemoi.models.distributed.shapes import BipartiteGraphShardInfo, GraphShardInfo  # noqa: E402
from anemoi.models.layers.mapper import GNNForwardMapper  # noqa: E402
from anemoi.models.layers.processor import GNNProcessor  # noqa: E402
from anemoi.models.layers.utils import load_layer_kernels  # noqa: E402
from bench_graphtransformer import encoder_graph, processor_graph  # noqa: E402

from stormshard.layers.gnn import EdgeBufferPool, GNNMapperBlock, GNNProcessorBlock, gnn_mlp  # noqa: E402
from stormshard.parallel.graph import GraphShardPlan  # noqa: E402


def copy_mlp(dst: torch.nn.Sequential, src: torch.nn.Module, swap_first: int = 0) -> None:
    """anemoi ``MLP`` -> stormshard :func:`gnn_mlp`; ``swap_first=C``: anemoi's edge MLP reads
    ``[x_i, x_j, e]``, stormshard's ``[x_j, x_i, e]`` (the first linear's input blocks swapped)."""
    lin_a = [m for m in src.mlp if isinstance(m, torch.nn.Linear)]
    lin_s = [m for m in dst if isinstance(m, torch.nn.Linear)]
    assert len(lin_a) == len(lin_s), (len(lin_a), len(lin_s))
    for i, (a, s) in enumerate(zip(lin_a, lin_s, strict=True)):
        w = a.weight.data
        if i == 0 and swap_first:
            c = swap_first
            w = torch.cat([w[:, c:2 * c], w[:, :c], w[:, 2 * c:]], 1)
        s.weight.data.copy_(w)
        s.bias.data.copy_(a.bias.data)
    dst[-1].weight.data.copy_(src.layer_norm.weight.data)
    dst[-1].bias.data.copy_(src.layer_norm.bias.data)


def check(name: str, ours: torch.Tensor, theirs: torch.Tensor, n_ours: int, n_theirs: int) -> bool:
    err = float((ours - theirs).detach().abs().max() / theirs.detach().abs().max())
    ok = n_ours == n_theirs and err < 1e-12
    print(f"{name}: params anemoi {n_theirs} stormshard {n_ours}, max relative output difference {err:.1e}: "
          f"{'equal' if ok else 'DIFFERENT'}", flush=True)
    return ok


def main() -> None:
    torch.set_default_dtype(torch.float64)
    torch.manual_seed(0)
    c, extra, kernels = ARGS.channels, ARGS.mlp_extra_layers, load_layer_kernels(instance=False)
    depth = extra + 2

    n, layers = 200, 3
    edge_index, edge_attr = processor_graph(n, 4)
    edge_attr = edge_attr.double()
    anemoi = GNNProcessor(num_layers=layers, num_channels=c, num_chunks=1, mlp_extra_layers=extra, edge_dim=4,
                          layer_kernels=kernels, gradient_checkpointing=False)
    plan = GraphShardPlan.build(edge_index, n)
    pool = EdgeBufferPool()  # one pool for the processor's blocks, as the models build them
    blocks = torch.nn.ModuleList(
        GNNProcessorBlock(c, c, plan, mlp_hidden_layers=depth, aggregate_updated_edges=True,
                          edge_in_channels=4 if i == 0 else None, buffer_pool=pool) for i in range(layers))
    for a, s in zip(anemoi.proc, blocks, strict=True):
        copy_mlp(s.edge_mlp, a.conv.edge_mlp, swap_first=c)
        copy_mlp(s.node_mlp, a.node_mlp)
        if a.emb_edges is not None:
            copy_mlp(s.edge_embedding, a.emb_edges)
    x = torch.randn(n, c)
    ref = anemoi(x, batch_size=1, shard_info=GraphShardInfo(nodes=[n], edges=None), edge_attr=edge_attr,
                 edge_index=edge_index)
    y, e = x, plan.shard_edges(edge_attr)
    for block in blocks:
        y, e = block(y, e)
    ok = check("N1 processor", y, ref, sum(t.numel() for t in blocks.parameters()),
               sum(t.numel() for t in anemoi.parameters()))

    nd, nh, in_src, in_dst = 300, 100, 7, 5
    edge_index, edge_attr = encoder_graph(nd, nh, 3)
    edge_attr = edge_attr.double()
    anemoi = GNNForwardMapper(in_channels_src=in_src, in_channels_dst=in_dst, num_channels=c, num_chunks=1,
                              mlp_extra_layers=extra, edge_dim=4, layer_kernels=kernels, gradient_checkpointing=False)
    plan = GraphShardPlan.build(edge_index, (nd, nh))
    embed_src, embed_dst = gnn_mlp(in_src, c, c, depth), gnn_mlp(in_dst, c, c, depth)
    block = GNNMapperBlock(c, c, c, plan, mlp_hidden_layers=depth, edge_in_channels=4, aggregate_updated_edges=True)
    copy_mlp(embed_src, anemoi.emb_nodes_src)
    copy_mlp(embed_dst, anemoi.emb_nodes_dst)
    copy_mlp(block.edge_embedding, anemoi.emb_edges)
    copy_mlp(block.edge_mlp, anemoi.proc.conv.edge_mlp, swap_first=c)
    copy_mlp(block.node_mlp, anemoi.proc.node_mlp)
    xs, xd = torch.randn(nd, in_src), torch.randn(nh, in_dst)
    ref_src, ref = anemoi((xs, xd), batch_size=1, edge_attr=edge_attr, edge_index=edge_index,
                          shard_info=BipartiteGraphShardInfo(src_nodes=[nd], dst_nodes=[nh], edges=None))
    h_src = embed_src(xs)
    out = block(h_src, embed_dst(xd), plan.shard_edges(edge_attr))
    n_ours = sum(t.numel() for m in (embed_src, embed_dst, block) for t in m.parameters())
    ok &= check("N2 forward mapper", out, ref, n_ours, sum(t.numel() for t in anemoi.parameters()))
    # anemoi's update_src_nodes, as bench_graph_vs_anemoi.py --src-update 1 computes it
    src_update = h_src + block.node_mlp(torch.cat([h_src, h_src], dim=-1))
    ok &= check("N2 data-node update", src_update, ref_src, n_ours, n_ours)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
