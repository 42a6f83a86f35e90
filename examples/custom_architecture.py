"""A new architecture from stormshard's parallel layers, in two forms.

1. ``build`` (:data:`~stormshard.models.registry.ModelBuilder` signature): a weather model the
   training entry builds from JSON, ``"model": {"name": "examples.custom_architecture:build",
   "options": {...}}`` (``examples/custom_architecture.json``). :class:`GridTransformer` is a
   sliding-window transformer straight on the grid cells (no hidden mesh): a Megatron-style
   embedding (column-parallel, GELU, row-parallel, sequence-parallel over the grid shard), a
   :class:`~stormshard.layers.transformer.TransformerProcessor` split as the run's
   ``parallel.shard_strategy`` says (``shard_sequence``, ``shard_heads`` or ``tensor``: the
   parallelize step swaps the blocks), a linear head and residual prediction. Everything parallel
   comes from the ``plan`` the builder receives; ``forward`` is single-device code.
2. ``WindowNet`` + ``train``: the layers in a bare loop on 2 gloo processes, without the trainer
   (``python examples/custom_architecture.py``). A tensor-parallel MLP embeds tokens (dropout from
   the tensor-parallel RNG region), a ``SlidingWindowAttention`` mixes neighbouring tokens (halo
   exchange), a linear head predicts a smoothed copy of the input.

Train (1) on 2 CPU processes from the repository root (``launch/train.py`` puts the root on
``sys.path``, so ``examples`` imports as a package)::

    python -m stormshard.data.synthetic --grid o16 --steps 600 --out data/synthetic.zarr --if-missing
    torchrun --nproc_per_node 2 launch/train.py --config examples/custom_architecture.json
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from stormshard.graphs.hetero import HeteroGraph
from stormshard.layers.attention import SlidingWindowAttention
from stormshard.layers.transformer import TransformerProcessor
from stormshard.models.config import ModelConfig
from stormshard.models.encoder_processor_decoder import coordinate_features
from stormshard.models.sharding import ModelShardPlan
from stormshard.models.variables import VariableIndex
from stormshard.parallel.grads import reduce_model_parallel_gradients
from stormshard.parallel.random import TrackedDropout, tensor_parallel_rng_tracker
from stormshard.parallel.shard import SequenceShard
from stormshard.parallel.tensor import ColumnParallelLinear, RowParallelLinear

# ------------------------------------------------------------------------------------------
# 1. a model the training entry builds: model.name = "examples.custom_architecture:build"
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GridOptions:
    """``model.options`` of :class:`GridTransformer` (every key optional)."""

    num_layers: int = 2
    num_heads: int = 4
    window_size: int = 16
    mlp_ratio: int = 2

    @classmethod
    def from_config(cls, config: ModelConfig) -> GridOptions:
        """Read and check ``config.options``; ValueError naming ``model.options.<key>`` and the fix."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(config.options) - set(known))
        if unknown:
            raise ValueError(f"model.options has unknown keys {unknown}: GridTransformer reads {known}")
        options = cls(**config.options)
        for name in known:
            value, least = getattr(options, name), 0 if name == "window_size" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"model.options.{name}={value!r} must be an integer of at least {least}")
        if config.num_channels % options.num_heads:
            raise ValueError(f"model.num_channels={config.num_channels} is not divisible by model.options.num_heads="
                             f"{options.num_heads}: choose heads dividing the channels")
        return options


class GridTransformer(nn.Module):
    """A sliding-window transformer on this rank's grid cells, in the grid's stored order.

    ``forward(x (batch, multistep_input, grid_local, input_variables))`` -> ``(batch, grid_local,
    output_variables)``: the next normalised state on the same cells (``plan.data_slice``).
    """

    def __init__(self, config: ModelConfig, graph: HeteroGraph, variables: VariableIndex,
                 plan: ModelShardPlan) -> None:
        super().__init__()
        opts = GridOptions.from_config(config)
        c, shard = config.num_channels, plan.data_shard
        self.config, self.plan = config, plan
        self.register_buffer("coords", coordinate_features(graph["data"].x[plan.data_slice].double()).float(),
                             persistent=False)
        n_in = config.multistep_input * len(variables.input_names) + 4
        # Megatron-style embedding: gathers the grid shard in, reduce-scatters it out
        self.embed_in = ColumnParallelLinear(n_in, 2 * c, sequence_shard=shard)
        self.embed_out = RowParallelLinear(2 * c, c, sequence_shard=shard)
        self.processor = TransformerProcessor(opts.num_layers, c, opts.num_heads, opts.window_size, opts.mlp_ratio,
                                              plan.shard_strategy, shard)
        self.head = nn.Sequential(nn.LayerNorm(c), nn.Linear(c, len(variables.output_names)))
        self.register_buffer("prognostic_in_input", torch.tensor(variables.prognostic_in_input), persistent=False)
        self.register_buffer("prognostic_in_output", torch.tensor(variables.prognostic_in_output), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        dtype = self.head[1].weight.dtype  # compute dtype (bf16 under training.precision "bf16")
        states = rearrange(x, "b t g v -> b g (t v)").to(dtype)                        # (b, g_local, t * v)
        coords = self.coords.to(dtype).expand(x.shape[0], -1, -1)                        # (b, g_local, 4)
        h = self.embed_out(F.gelu(self.embed_in(torch.cat([states, coords], dim=-1))))  # (b, g_local, C)
        out = self.head(self.processor(h))                                              # (b, g_local, v_out)
        last = x[:, -1]  # residual prediction of the prognostic variables, in the input's dtype
        residual = last.new_zeros(out.shape).index_copy(-1, self.prognostic_in_output,
                                                        last.index_select(-1, self.prognostic_in_input))
        return out.to(last.dtype) + residual


def build(config: ModelConfig, graph: HeteroGraph, variables: VariableIndex, plan: ModelShardPlan) -> nn.Module:
    """The :data:`~stormshard.models.registry.ModelBuilder` of :class:`GridTransformer`."""
    return GridTransformer(config, graph, variables, plan)


# ------------------------------------------------------------------------------------------
# 2. the layers in a bare training loop (python examples/custom_architecture.py)
# ------------------------------------------------------------------------------------------

WORLD, FEATURES, CHANNELS, SEQ, STEPS = 2, 4, 32, 63, 25


class WindowNet(nn.Module):
    """Every layer gets the sequence's shard (sizes + group) once; ``forward`` takes tensors only."""

    def __init__(self, shard: SequenceShard, tracker: Any) -> None:
        super().__init__()
        self.embed = ColumnParallelLinear(FEATURES, 4 * CHANNELS, sequence_shard=shard)
        self.dropout = TrackedDropout(0.1, tracker)  # hidden channels differ per rank: so do the masks
        self.mix = RowParallelLinear(4 * CHANNELS, CHANNELS, sequence_shard=shard)
        self.attention = SlidingWindowAttention(CHANNELS, num_heads=4, window_size=3, shard=shard)
        self.head = nn.Linear(CHANNELS, FEATURES)

    def forward(self, x: Tensor) -> Tensor:
        h = self.mix(self.dropout(F.gelu(self.embed(x))))  # (batch, seq_local, channels)
        return self.head(h + self.attention(h))


def train(rank: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    group = dist.group.WORLD
    shard = SequenceShard.balanced(SEQ, group)  # 32 / 31 tokens
    torch.manual_seed(0)  # same seed on every rank: same full weights, each rank keeps its slices
    model = WindowNet(shard, tensor_parallel_rng_tracker(seed=0, group=group))
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    x = torch.randn(8, SEQ, FEATURES, generator=torch.Generator().manual_seed(1))
    target = (x.roll(1, 1) + x + x.roll(-1, 1)) / 3
    x, target = x[:, shard.local_slice], target[:, shard.local_slice]
    for step in range(STEPS):  # mean squared error over the whole sequence = sum of the ranks' parts
        loss = (model(x) - target).square().sum() / (x.shape[0] * SEQ * FEATURES)
        optimizer.zero_grad()
        loss.backward()
        reduce_model_parallel_gradients(model.parameters(), group)  # replicated weights saw our tokens only
        optimizer.step()
        total = loss.detach()
        dist.all_reduce(total, group=group)
        if rank == 0 and (step % 8 == 0 or step == STEPS - 1):
            print(f"step {step:2d} loss {total.item():.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(s.getsockname()[1]))
    torch.set_num_threads(1)
    mp.spawn(train, nprocs=WORLD)
