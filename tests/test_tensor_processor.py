"""Tensor-parallel attention, MLP, block and processor equal engineer A's single-process modules.

Every case builds the tensor-parallel module from the same full weights as the reference
(``TransformerProcessor`` / ``TransformerBlock`` / ``SlidingWindowAttention`` / ``MLP`` of
``stormshard.layers``) and compares, in float64, the outputs, the input gradients and the gathered
parameter gradients, with sequence parallelism (uneven sequence shards) and without.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from stormshard.layers.checkpointing import ActivationCheckpoint, checkpoint_blocks
from stormshard.layers.tensor_parallel import (
    TensorParallelMLP,
    TensorParallelSlidingWindowAttention,
    TensorParallelTransformerBlock,
)
from stormshard.layers.transformer import TransformerBlock, TransformerProcessor
from stormshard.models.parallelize import build_transformer_processor
from stormshard.parallel.comm import all_gather_along
from stormshard.parallel.counter import CommCounter
from stormshard.parallel.grads import reduce_model_parallel_gradients
from stormshard.parallel.partition import get_partition
from stormshard.parallel.shapes import balanced_sizes
from stormshard.parallel.shard import SequenceShard
from stormshard.parallel.tensor import full_state_dict, load_full_state_dict
from tests.distributed import run_distributed

F64 = torch.float64
TIGHT = {"rtol": 1e-11, "atol": 1e-11}
EXACT = {"rtol": 0.0, "atol": 0.0}
WINDOW = 3


def _narrow(t, dim, sizes, index):
    return t.narrow(dim, sum(sizes[:index]), sizes[index])


def _reference(num_channels, num_heads, mlp_ratio, num_layers=2):
    """A's processor, float64, with random layer-norm affine parameters (so their gradients matter)."""
    torch.manual_seed(0)
    ref = TransformerProcessor(num_layers, num_channels, num_heads, WINDOW, mlp_ratio=mlp_ratio)
    initial = {k: v.detach().clone() for k, v in ref.state_dict().items()}
    ref = ref.double()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=F64))
    return ref, initial


def _compare(ref, tp, rank, world, group, num_channels, seq, sp, call):
    """Run ``call(module, x)`` on both (``tp`` built for ``sp``); compare outputs, input grads and gathered param grads.

    Returns the collectives of the tensor-parallel forward + backward (without the gradient sum).
    """
    sizes = balanced_sizes(seq, world)
    g = torch.Generator().manual_seed(7)
    x_full = torch.randn(2, seq, num_channels, generator=g, dtype=F64)
    w_full = torch.randn(2, seq, num_channels, generator=g, dtype=F64)
    ref.zero_grad(set_to_none=True)
    tp.zero_grad(set_to_none=True)
    x_ref = x_full.clone().requires_grad_()
    y_ref = call(ref, x_ref)
    (y_ref * w_full).sum().backward()

    x = (_narrow(x_full, 1, sizes, rank) if sp else x_full).clone().requires_grad_()
    with CommCounter() as counter:
        y = call(tp, x)
        # sequence parallel: the loss is the sum of every rank's; otherwise every rank computes it whole
        (y * (_narrow(w_full, 1, sizes, rank) if sp else w_full)).sum().backward()
    torch.testing.assert_close(y, _narrow(y_ref, 1, sizes, rank) if sp else y_ref, **TIGHT)
    torch.testing.assert_close(x.grad, _narrow(x_ref.grad, 1, sizes, rank) if sp else x_ref.grad, **TIGHT)
    if sp:  # replicated parameters saw only this rank's tokens: the project's model-group sum
        reduce_model_parallel_gradients(tp.parameters(), group)
    ref_params = dict(ref.named_parameters())
    names = [name for name, _ in tp.named_parameters()]
    assert names == list(ref_params), "parameter names differ from the single-process module"
    for name, p in tp.named_parameters():
        grad, part = p.grad, get_partition(p)
        if part is not None:
            grad = all_gather_along(grad.contiguous(), part.dim, part.sizes, group)
        torch.testing.assert_close(grad, ref_params[name].grad, **TIGHT, msg=lambda m, n=name: f"{n}: {m}")
    return counter.as_dict()


def _subgroup(rank, world):
    """Two halves of the world; this rank's half (the second lacks global rank 0), its rank and size."""
    half = world // 2
    groups = [dist.new_group(list(range(half))), dist.new_group(list(range(half, world)))]
    return groups[rank // half], rank % half, half


def _processor_cases(rank, world, num_channels, num_heads, mlp_ratio, seq, split=False):
    group = dist.group.WORLD
    if split:
        group, rank, world = _subgroup(rank, world)
    ref, initial = _reference(num_channels, num_heads, mlp_ratio)

    # fresh initialisation: same seed -> the same full weights as A's processor, whatever the layout
    shard = SequenceShard(balanced_sizes(seq, world), group)
    torch.manual_seed(0)
    tp = build_transformer_processor(2, num_channels, num_heads, WINDOW, mlp_ratio=mlp_ratio,
                                     shard_strategy="tensor", shard=shard)
    assert all(isinstance(b, TensorParallelTransformerBlock) for b in tp.blocks)
    gathered = full_state_dict(tp, group)
    assert list(gathered) == list(initial)
    for name, value in initial.items():
        torch.testing.assert_close(gathered[name], value, **EXACT, msg=lambda m, n=name: f"init of {n}: {m}")

    tp = tp.double()
    load_full_state_dict(tp, ref.state_dict())
    # tensor parallel only: the same blocks over the full sequence, replicated on every rank
    tp_only = TransformerProcessor(2, num_channels, num_heads, WINDOW, mlp_ratio=mlp_ratio).double()
    for i, block in enumerate(tp_only.blocks):
        tp_only.blocks[i] = TensorParallelTransformerBlock.from_block(block, group=group)
    load_full_state_dict(tp_only, ref.state_dict())
    counts = {}
    for sp, module in ((True, tp), (False, tp_only)):
        counts[sp] = _compare(ref, module, rank, world, group, num_channels, seq, sp, lambda m, x: m(x))
    # activation checkpointing recomputes the block, its collectives included; names unchanged
    checkpoint_blocks(tp.blocks)
    assert all(isinstance(b, ActivationCheckpoint) for b in tp.blocks)
    assert list(full_state_dict(tp, group)) == list(initial)
    _compare(ref, tp, rank, world, group, num_channels, seq, True, lambda m, x: m(x))

    # one block, sliced with from_block; and the attention and MLP on their own
    block = ref.blocks[1]
    for sp in (True, False):
        seq_shard = shard if sp else None
        tp_block = TensorParallelTransformerBlock.from_block(block, seq_shard, group=group)
        for name, value in full_state_dict(tp_block, group).items():
            torch.testing.assert_close(value, block.state_dict()[name], **EXACT)
        attention = TensorParallelSlidingWindowAttention.from_attention(block.attention, seq_shard, group=group)
        mlp = TensorParallelMLP.from_mlp(block.mlp, seq_shard, group=group)
        _compare(block, tp_block, rank, world, group, num_channels, seq, sp, lambda m, x: m(x))
        _compare(block.attention, attention, rank, world, group, num_channels, seq, sp, lambda m, x: m(x))
        _compare(block.mlp, mlp, rank, world, group, num_channels, seq, sp, lambda m, x: m(x))
    return counts


def _expected_counts(world, seq, num_channels, sp):
    """Calls and bytes per rank for 2 blocks, forward + backward (float64, batch 2)."""
    if world == 1:
        return {}
    if sp:
        largest = max(balanced_sizes(seq, world))
        gather_bytes = 2 * largest * num_channels * 8 * (world - 1)   # one padded shard to w - 1 ranks
        scatter_bytes = 2 * largest * world * num_channels * 8 * (world - 1) // world
        # per block: forward 2 gathers + 2 reduce-scatters, backward 2 + 2; nothing else
        return {"all_gather": (8, 8 * gather_bytes), "reduce_scatter": (8, 8 * scatter_bytes)}
    # per block: forward 2 all-reduces (after attention and MLP), backward 2 (copy_tensor adjoints)
    return {"all_reduce_calls": 8}


@pytest.mark.parametrize("world", [1, 2, 4])
def test_processor_matches_single_process(world):
    """4 heads over 1, 2 or 4 ranks; 11 tokens (uneven shards on 2 and 4 ranks)."""
    seq, channels = 11, 16
    results = run_distributed(_processor_cases, world, channels, 4, 2, seq)
    for counts in results:
        for sp in (True, False):
            expected = _expected_counts(world, seq, channels, sp)
            if not expected:
                assert counts[sp] == {}
                continue
            if sp:
                assert set(counts[sp]) == {"all_gather", "reduce_scatter"}
                assert (counts[sp]["all_gather"]["calls"], counts[sp]["all_gather"]["bytes"]) == expected["all_gather"]
                assert (counts[sp]["reduce_scatter"]["calls"],
                        counts[sp]["reduce_scatter"]["bytes"]) == expected["reduce_scatter"]
            else:
                assert set(counts[sp]) == {"all_reduce"}
                assert counts[sp]["all_reduce"]["calls"] == expected["all_reduce_calls"]


def test_processor_on_subgroups():
    """4 ranks split into two model groups of 2 (one without global rank 0), each its own processor."""
    run_distributed(_processor_cases, 4, 16, 4, 2, 9, split=True)


def _error_cases(rank, world):
    """On 3 ranks."""
    group = dist.group.WORLD
    with pytest.raises(ValueError, match=rf"num_heads=4 is not divisible by the tensor-parallel group size {world}"):
        TensorParallelTransformerBlock(12, 4, WINDOW, group=group)
    with pytest.raises(ValueError, match=rf"num_heads=4 is not divisible .* size {world}"):
        build_transformer_processor(1, 12, 4, WINDOW, shard_strategy="tensor", shard=SequenceShard.balanced(10, group))
    with pytest.raises(ValueError, match=r"MLP hidden size mlp_ratio \* num_channels = 4 is not divisible by .* 3"):
        TensorParallelTransformerBlock(4, 3, WINDOW, mlp_ratio=1, group=group)
    with pytest.raises(ValueError, match=r"num_heads=4 is not divisible"):
        TensorParallelTransformerBlock.from_block(TransformerBlock(12, 4, WINDOW), SequenceShard([4, 3, 3], group))
    # the channels are split over the shard's group: a different group is refused at construction
    with pytest.raises(ValueError, match=r"shard is split over a different process group \(1 ranks\) than group "
                                         rf"\({world} ranks\)"):
        TensorParallelTransformerBlock(6, 3, WINDOW, mlp_ratio=2, shard=SequenceShard.unsharded(2), group=group)
    block = TensorParallelTransformerBlock(6, 3, WINDOW, mlp_ratio=2, shard=SequenceShard([4] * world, group))
    with pytest.raises(ValueError, match=rf"input x has 2 rows along dim 1 .* gives this rank \(rank {rank} of "
                                         rf"{world}\) 4 of sizes"):
        block(torch.randn(1, 2, 6))
    with pytest.raises(ValueError, match=r"x must be \(batch, seq_local, 6\)"):
        block(torch.randn(2, 6))
    return True


def test_three_ranks_uneven_and_errors():
    """3 heads over 3 ranks, 10 tokens (4/3/3), and the size errors on 3 ranks (4 heads do not split)."""
    assert all(run_distributed(_error_cases, 3))
    run_distributed(_processor_cases, 3, 12, 3, 2, 10)
