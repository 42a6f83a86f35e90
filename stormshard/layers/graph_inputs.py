"""Input checks shared by the graph blocks (graph transformer and GNN): plans, rows, shapes, sizes.

Node tensors are ``(rows, [*batch,] channels)``, ``edge_attr`` ``(num_edges, [*batch,] channels)``;
a block's plan is a :class:`~stormshard.parallel.graph.GraphShardPlan`. Each check raises a
ValueError or TypeError naming the argument and the fix.
"""

from __future__ import annotations

from torch import Tensor, nn

from stormshard.layers.chunking import shared_to
from stormshard.parallel.graph import GraphShardPlan

__all__ = ["check_positive_int", "check_plan", "check_local_rows", "check_node_and_edge_shapes"]


def check_positive_int(name: str, value: object) -> int:
    """``value`` if it is a positive int (not a bool), else a ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_plan(plan: object, processor: bool) -> GraphShardPlan:
    """``plan`` if it is a :class:`GraphShardPlan` (on one node set for a ``processor``), else an error."""
    if not isinstance(plan, GraphShardPlan):
        raise TypeError(
            f"plan must be a GraphShardPlan, got {type(plan).__name__}: build one with "
            "GraphShardPlan.build(edge_index, num_nodes, group) (group None for one process)"
        )
    if processor and plan.num_src != plan.num_dst:
        raise ValueError(
            f"a processor plan must be built on one node set, got {plan.num_src} sources and "
            f"{plan.num_dst} destinations: build it with num_nodes=<int>"
        )
    return plan


def check_local_rows(plan: GraphShardPlan, x_src_rows: int, x_dst_rows: int, edge_attr: Tensor) -> None:
    """Raise unless the node and edge inputs are this rank's rows of the plan's graph."""
    if x_src_rows != plan.num_src_local or x_dst_rows != plan.num_dst_local:
        raise ValueError(
            f"node inputs have {x_src_rows} source and {x_dst_rows} destination rows but rank "
            f"{plan.rank}'s plan owns {plan.num_src_local} and {plan.num_dst_local}: pass this "
            "rank's node slices (plan.shard_src / plan.shard_dst)"
        )
    if edge_attr.shape[0] != plan.num_edges_local:
        raise ValueError(
            f"edge_attr must be (num_edges, edge_channels) with num_edges = {plan.num_edges_local} (rank "
            f"{plan.rank}'s edges in the plan), got {tuple(edge_attr.shape)}: pass plan.shard_edges(edge_attr)"
        )


def check_node_and_edge_shapes(
    x_src: Tensor, x_dst: Tensor, edge_attr: Tensor, src_channels: int, dst_channels: int, edge_channels: int
) -> None:
    """Node tensors ``(rows, *batch, channels)`` with the same batch dims; edges ``(E, [*batch,] channels)``."""
    for name, t, want in (("x_src", x_src, src_channels), ("x_dst", x_dst, dst_channels),
                          ("edge_attr", edge_attr, edge_channels)):
        if t.dim() < 2 or t.shape[-1] != want:
            raise ValueError(f"{name} must be (rows, [*batch,] {want}), got {tuple(t.shape)}")
    batch = tuple(x_dst.shape[1:-1])
    if tuple(x_src.shape[1:-1]) != batch:
        raise ValueError(
            f"x_src has batch dims {tuple(x_src.shape[1:-1])} but x_dst has {batch}: node tensors are (rows, *batch, C)"
        )
    if edge_attr.dim() > 2 and tuple(edge_attr.shape[1:-1]) != batch:
        raise ValueError(f"edge_attr has batch dims {tuple(edge_attr.shape[1:-1])} but the nodes have {batch}")


class PlanFollowsModule(nn.Module):
    """Base of the graph blocks that hold ``self.plan`` (a :class:`GraphShardPlan`) and
    ``self.edge_chunks`` (and, in graph-transformer blocks, ``self.chunk_index``): ``module.to(device)`` /
    ``.cuda()`` moves the plan's index tensors and the chunks' edge ids and edge indices with the parameters. The forward then never copies them (on a GPU a copy per
    call would also be a new tensor each time, missing the CSR caches keyed by the index tensor)."""

    plan: GraphShardPlan
    edge_chunks: tuple[tuple[int, int, Tensor], ...] | None

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 - nn.Module's signature
        out = super()._apply(fn, recurse)
        tensors = [*self.parameters(), *self.buffers()]
        if not tensors:
            return out
        device = tensors[0].device  # where the call left the parameters (a dtype change leaves them)
        if self.plan.edge_index.device != device:
            self.plan = self.plan.to(device)
            # one moved copy per tensor and device: the blocks sharing a plan share its chunks too
            if self.edge_chunks is not None:
                self.edge_chunks = tuple((first, end, shared_to(ids, device)) for first, end, ids in self.edge_chunks)
            if getattr(self, "chunk_index", None) is not None:
                self.chunk_index = {first: shared_to(index, device) for first, index in self.chunk_index.items()}
        return out
