"""How one model instance is sharded over its model-communication group (computed once).

Each rank of the group holds a balanced contiguous slice of the data nodes (the grid) and of the
hidden nodes; the encoder, decoder (and graph processor) are sharded by destination node with a
:class:`~stormshard.parallel.graph.GraphShardPlan` each, whose source and destination slices are
exactly these node slices, so activations move between layers without re-sharding. The plan holds
the model group (``group``) and how the sequence processor is split over it (``shard_strategy``,
the run's ``parallel.shard_strategy``), and is handed to the model once, at construction.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from stormshard.graphs.builder import DECODER, ENCODER, PROCESSOR
from stormshard.graphs.hetero import HeteroGraph
from stormshard.parallel.graph import GraphShardPlan
from stormshard.parallel.shapes import balanced_sizes, group_rank, group_size
from stormshard.parallel.shard import SequenceShard, ShardStrategy

__all__ = ["ModelShardPlan"]


@dataclass(frozen=True, eq=False)
class ModelShardPlan:
    """Node slices and graph plans of this rank of the model group ``group`` (None: one process).

    ``data_sizes`` / ``hidden_sizes``: every rank's number of data (grid) / hidden nodes, rank
    order; ``encoder`` (data -> hidden), ``decoder`` (hidden -> data) and ``processor`` (hidden ->
    hidden, None without a graph processor) are this rank's graph plans, built with ``group``;
    ``shard_strategy``: how a sliding-window processor splits over ``group`` (``"shard_sequence"``,
    ``"shard_heads"`` or ``"tensor"``; graph processors shard by destination node whatever it is).
    Checked against the model by :func:`~stormshard.models.parallelize.check_parallel_strategy`.
    """

    data_sizes: tuple[int, ...]
    hidden_sizes: tuple[int, ...]
    encoder: GraphShardPlan
    decoder: GraphShardPlan
    processor: GraphShardPlan | None
    group: dist.ProcessGroup | None = None
    shard_strategy: ShardStrategy = "shard_sequence"

    @classmethod
    def build(
        cls, graph: HeteroGraph, model_group: dist.ProcessGroup | None, processor_graph: bool,
        shard_strategy: ShardStrategy = "shard_sequence",
    ) -> ModelShardPlan:
        """The plan of this rank of ``model_group`` for ``graph`` (``processor_graph``: build the
        hidden -> hidden plan too; ``shard_strategy``: kept as given). Computed on every rank without
        communication."""
        num_data, num_hidden = graph["data"].num_nodes, graph["hidden"].num_nodes
        world = group_size(model_group)
        for name, count in (("data", num_data), ("hidden", num_hidden)):
            if count < world:
                raise ValueError(
                    f"the graph has {count} {name} nodes, fewer than the {world} ranks of the model group: "
                    f"lower gpus_per_model to at most {count}"
                )
        encoder = GraphShardPlan.build(graph[ENCODER].edge_index, (num_data, num_hidden), model_group)
        decoder = GraphShardPlan.build(graph[DECODER].edge_index, (num_hidden, num_data), model_group)
        processor = (
            GraphShardPlan.build(graph[PROCESSOR].edge_index, num_hidden, model_group) if processor_graph else None
        )
        return cls(tuple(balanced_sizes(num_data, world)), tuple(balanced_sizes(num_hidden, world)),
                   encoder, decoder, processor, model_group, shard_strategy)

    @property
    def world(self) -> int:
        """Number of ranks of the model group."""
        return group_size(self.group)

    @property
    def rank(self) -> int:
        """This process's rank in the model group."""
        return group_rank(self.group)

    @property
    def data_shard(self) -> SequenceShard:
        """How the data (grid) node dimension is split over the model group."""
        return SequenceShard(self.data_sizes, self.group)

    @property
    def hidden_shard(self) -> SequenceShard:
        """How the hidden node dimension is split over the model group."""
        return SequenceShard(self.hidden_sizes, self.group)

    @property
    def num_data(self) -> int:
        return sum(self.data_sizes)

    @property
    def num_hidden(self) -> int:
        return sum(self.hidden_sizes)

    @property
    def data_slice(self) -> slice:
        """This rank's rows of the full data-node dimension."""
        return self.data_shard.local_slice

    @property
    def hidden_slice(self) -> slice:
        """This rank's rows of the full hidden-node dimension."""
        return self.hidden_shard.local_slice
