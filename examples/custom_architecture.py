"""A new small architecture from stormshard's parallel layers, trained a few steps on 2 ranks.

Tokens ``(batch, seq, features)`` are sharded along the sequence over 2 gloo processes. A
tensor-parallel MLP embeds them (column-parallel, dropout drawn from the tensor-parallel RNG region,
row-parallel; Megatron sequence parallelism: all-gather in, reduce-scatter out), a
SlidingWindowAttention mixes neighbouring tokens (halo exchange), a linear head predicts a smoothed
copy of the input. Run: ``python examples/custom_architecture.py``.
"""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from stormshard.layers.attention import SlidingWindowAttention
from stormshard.parallel.grads import reduce_model_parallel_gradients
from stormshard.parallel.random import TrackedDropout, tensor_parallel_rng_tracker
from stormshard.parallel.shard import SequenceShard
from stormshard.parallel.tensor import ColumnParallelLinear, RowParallelLinear

WORLD, FEATURES, CHANNELS, SEQ, STEPS = 2, 4, 32, 63, 25


class WindowNet(nn.Module):
    """Every layer gets the sequence's shard (sizes + group) once; ``forward`` takes tensors only."""

    def __init__(self, shard: SequenceShard, tracker) -> None:
        super().__init__()
        self.embed = ColumnParallelLinear(FEATURES, 4 * CHANNELS, sequence_shard=shard)
        self.dropout = TrackedDropout(0.1, tracker)  # hidden channels differ per rank: so do the masks
        self.mix = RowParallelLinear(4 * CHANNELS, CHANNELS, sequence_shard=shard)
        self.attention = SlidingWindowAttention(CHANNELS, num_heads=4, window_size=3, shard=shard)
        self.head = nn.Linear(CHANNELS, FEATURES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
