"""How one model instance is sharded over its model-communication group (computed once).

Each rank of the group holds a balanced contiguous slice of the data nodes (the grid) and of the
hidden nodes; the encoder, decoder (and graph processor) are sharded by destination node with a
:class:`~stormshard.parallel.graph.GraphShardPlan` each, whose source and destination slices are
exactly these node slices, so activations move between layers without re-sharding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist
from torch_geometric.data import HeteroData

from stormshard.graphs.builder import DECODER, ENCODER, PROCESSOR
from stormshard.parallel.graph import GraphShardPlan
from stormshard.parallel.shapes import balanced_offsets, balanced_sizes, group_rank, group_size

__all__ = ["ModelShardPlan"]


@dataclass(frozen=True, eq=False)
class ModelShardPlan:
    """Node slices and graph plans of one rank (``rank`` of ``world``)."""

    world: int
    rank: int
    data_sizes: tuple[int, ...]
    hidden_sizes: tuple[int, ...]
    encoder: GraphShardPlan
    decoder: GraphShardPlan
    processor: GraphShardPlan | None

    @classmethod
    def build(cls, graph: HeteroData, group: dist.ProcessGroup | None, processor_graph: bool) -> ModelShardPlan:
        num_data, num_hidden = graph["data"].num_nodes, graph["hidden"].num_nodes
        world, rank = group_size(group), group_rank(group)
        for name, count in (("data", num_data), ("hidden", num_hidden)):
            if count < world:
                raise ValueError(
                    f"the graph has {count} {name} nodes, fewer than the {world} ranks of the model group: "
                    f"lower gpus_per_model to at most {count}"
                )
        encoder = GraphShardPlan.build(graph[ENCODER].edge_index, (num_data, num_hidden), group)
        decoder = GraphShardPlan.build(graph[DECODER].edge_index, (num_hidden, num_data), group)
        processor = GraphShardPlan.build(graph[PROCESSOR].edge_index, num_hidden, group) if processor_graph else None
        return cls(world, rank, tuple(balanced_sizes(num_data, world)), tuple(balanced_sizes(num_hidden, world)),
                   encoder, decoder, processor)

    @property
    def num_data(self) -> int:
        return sum(self.data_sizes)

    @property
    def num_hidden(self) -> int:
        return sum(self.hidden_sizes)

    @property
    def data_slice(self) -> slice:
        start = balanced_offsets(self.data_sizes)[self.rank]
        return slice(start, start + self.data_sizes[self.rank])

    @property
    def hidden_slice(self) -> slice:
        start = balanced_offsets(self.hidden_sizes)[self.rank]
        return slice(start, start + self.hidden_sizes[self.rank])
