"""The parallelize step and activation checkpointing: names unchanged, numbers unchanged, checks once.

- :class:`ActivationCheckpoint` keeps the wrapped block's parameter and state-dict names, loads,
  moves and switches train/eval like the block, and gives the block's outputs and gradients.
- ``build_model`` (= construction + ``parallelize``) has the state-dict keys of the unparallelized
  model, and on 2 and 3 ranks (uneven hidden shards) its gathered tensor-parallel state dict is
  the unparallelized model's, value for value. Equality of outputs and gradients with one process
  through ``build_model`` is ``tests/test_models.py`` (``transformer-tensor``, checkpointed cases).
- Strategy errors come from the one check, naming the field.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from stormshard.graphs.builder import GraphConfig, KNNEdges, build_graph
from stormshard.layers.checkpointing import ActivationCheckpoint, checkpoint_blocks, unwrap_block
from stormshard.layers.gnn import GNNProcessorBlock
from stormshard.layers.parallelize import build_transformer_processor, parallelize_processor
from stormshard.layers.tensor_parallel import TensorParallelTransformerBlock
from stormshard.layers.transformer import TransformerBlock, TransformerProcessor
from stormshard.models.config import ModelConfig
from stormshard.models.encoder_processor_decoder import EncoderProcessorDecoder
from stormshard.models.ensemble import EnsembleEncoderProcessorDecoder
from stormshard.models.parallelize import check_parallel_strategy, parallelize
from stormshard.models.registry import build_model
from stormshard.models.sharding import ModelShardPlan
from stormshard.models.variables import VariableIndex
from stormshard.parallel.tensor import full_state_dict
from tests.distributed import run_distributed

F64 = torch.float64
VARIABLES = VariableIndex.build(["u", "v", "t", "insolation"], forcing=["insolation"])


@functools.lru_cache(maxsize=2)
def _graph(graph_processor: bool):
    if graph_processor:
        return build_graph(GraphConfig(data_grid="o4", hidden="ico1"))
    return build_graph(GraphConfig(data_grid="o4", hidden="o2", processor=KNNEdges(num_neighbours=4)))


def _config(name: str, strategy: str = "shard_sequence", checkpointing: bool = True, heads: int = 6) -> ModelConfig:
    return ModelConfig(name=name, num_channels=12, multistep_input=1, trainable_size=2,
                       processor=dict(num_layers=2, num_heads=heads, window_size=5, mlp_ratio=2,
                                      shard_strategy=strategy),
                       encoder=dict(num_heads=2), decoder=dict(num_heads=2), activation_checkpointing=checkpointing)


def _unparallelized(config: ModelConfig, group) -> nn.Module:  # noqa: ANN001
    cls = EnsembleEncoderProcessorDecoder if config.name == "ensemble" else EncoderProcessorDecoder
    return cls(config, _graph(config.uses_graph_processor), VARIABLES, group)


# ------------------------------------------------------------------------------------------
# ActivationCheckpoint
# ------------------------------------------------------------------------------------------


def _stack(blocks):
    model = nn.Module()
    model.blocks = nn.ModuleList(blocks)
    return model


def test_checkpoint_wrapper_keeps_names_and_numbers():
    torch.manual_seed(0)
    plain = _stack(TransformerBlock(8, 2, 3, 2) for _ in range(2)).double()
    torch.manual_seed(1)
    wrapped = _stack(TransformerBlock(8, 2, 3, 2) for _ in range(2)).double()
    names = [n for n, _ in wrapped.named_parameters()]
    keys = list(wrapped.state_dict())
    checkpoint_blocks(wrapped.blocks)
    checkpoint_blocks(wrapped.blocks)  # a second call changes nothing
    assert all(isinstance(b, ActivationCheckpoint) and isinstance(b.block, TransformerBlock) for b in wrapped.blocks)
    assert [n for n, _ in wrapped.named_parameters()] == names
    assert list(wrapped.state_dict()) == keys == list(plain.state_dict())
    assert "blocks.0.attention.lin_qkv.weight" in keys
    wrapped.load_state_dict(plain.state_dict())  # loads by the block's own names
    assert unwrap_block(wrapped.blocks[0]).attention is wrapped.blocks[0].attention
    assert wrapped.blocks[0].shard is None  # plain attributes read through

    x = torch.randn(2, 11, 8, dtype=F64)
    results = []
    for model in (plain, wrapped):
        xi = x.clone().requires_grad_()
        y = xi
        for block in model.blocks:
            y = block(y)
        y.square().sum().backward()
        results.append((y.detach(), xi.grad, [p.grad for p in model.parameters()]))
    torch.testing.assert_close(results[0][0], results[1][0], rtol=0, atol=0)
    torch.testing.assert_close(results[0][1], results[1][1], rtol=1e-12, atol=1e-12)
    for a, b in zip(results[0][2], results[1][2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)

    wrapped.eval()
    assert not wrapped.blocks[0].training and not wrapped.blocks[0].block.training
    wrapped.train()
    assert wrapped.blocks[1].block.training
    wrapped.float()
    assert wrapped.blocks[0].block.attention.lin_qkv.weight.dtype == torch.float32
    with torch.no_grad():  # no recording: a plain call
        torch.testing.assert_close(wrapped.blocks[0](x.float()), plain.blocks[0].float()(x.float()))
    with pytest.raises(TypeError, match="already wrapped"):
        ActivationCheckpoint(wrapped.blocks[0])


def test_checkpoint_wrapper_passes_tuples_through():
    """Graph blocks take and return ``(x, edge_attr)``; the wrapper passes both through."""
    from stormshard.parallel.graph import GraphShardPlan

    edge_index = torch.tensor([[0, 1, 2, 3, 4, 0], [1, 2, 3, 4, 0, 3]])
    plan = GraphShardPlan.build(edge_index, 5, None)
    torch.manual_seed(0)
    block = GNNProcessorBlock(4, 3, plan, mlp_ratio=2).double()
    wrapped = ActivationCheckpoint(block)
    x, e = torch.randn(5, 2, 4, dtype=F64), torch.randn(6, 3, dtype=F64)
    out_plain, out_wrapped = block(x, e), wrapped(x, e)
    for a, b in zip(out_plain, out_wrapped, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------
# the processor step (layers) and the model step
# ------------------------------------------------------------------------------------------


def test_parallelize_processor_order_and_idempotence():
    torch.manual_seed(0)
    proc = TransformerProcessor(2, 8, 2, 3, 2, "tensor")
    keys = list(proc.state_dict())
    parallelize_processor(proc, activation_checkpointing=True)
    parallelize_processor(proc, activation_checkpointing=True)
    assert all(isinstance(unwrap_block(b), TensorParallelTransformerBlock) for b in proc.blocks)
    assert all(isinstance(b, ActivationCheckpoint) for b in proc.blocks)
    assert list(proc.state_dict()) == keys
    torch.manual_seed(0)
    reference = TransformerProcessor(2, 8, 2, 3, 2)
    x = torch.randn(1, 9, 8)
    torch.testing.assert_close(proc(x), reference(x), rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="shard_strategy must be one of"):
        build_transformer_processor(1, 8, 2, 3, shard_strategy="ring")
    with pytest.raises(TypeError, match="processor must be a TransformerProcessor"):
        parallelize_processor(nn.Linear(2, 2))


@pytest.mark.parametrize("name,strategy", [("transformer", "tensor"), ("transformer", "shard_heads"),
                                           ("graphtransformer", "shard_sequence"), ("gnn", "shard_sequence"),
                                           ("ensemble", "shard_sequence")])
def test_build_model_keeps_state_dict_keys(name, strategy):
    config = _config(name, strategy)
    torch.manual_seed(5)
    before = _unparallelized(config, None)
    torch.manual_seed(5)
    after = build_model(config, _graph(config.uses_graph_processor), VARIABLES)
    assert list(after.state_dict()) == list(before.state_dict())
    assert [n for n, _ in after.named_parameters()] == [n for n, _ in before.named_parameters()]
    for key, value in before.state_dict().items():
        torch.testing.assert_close(after.state_dict()[key], value, rtol=0, atol=0)
    assert all(isinstance(b, ActivationCheckpoint) for b in after.processor.blocks)
    if strategy == "tensor":
        assert all(isinstance(unwrap_block(b), TensorParallelTransformerBlock) for b in after.processor.blocks)
        assert "processor.processor.blocks.0.attention.lin_qkv.weight" in before.state_dict()
    parallelize(after, config, after.plan)  # a second application changes nothing
    assert list(after.state_dict()) == list(before.state_dict())
    x = torch.randn(1, 1, _graph(config.uses_graph_processor)["data"].num_nodes, len(VARIABLES.input_names))
    if name != "ensemble":
        with torch.no_grad():
            torch.testing.assert_close(after(x), before(x), rtol=1e-5, atol=1e-6)


def _sliced_state_dict_equals_full(rank, world):
    group = dist.group.WORLD
    config = _config("transformer", "tensor", heads=world * 2)
    torch.manual_seed(5)
    before = _unparallelized(config, group)
    torch.manual_seed(5)
    after = build_model(config, _graph(False), VARIABLES, group)
    assert list(after.state_dict()) == list(before.state_dict())
    full = full_state_dict(after, group)
    for key, value in before.state_dict().items():
        torch.testing.assert_close(full[key], value, rtol=0, atol=0, msg=lambda m, k=key: f"{k}: {m}")
    sliced = after.state_dict()["processor.processor.blocks.0.mlp.fc1.weight"]
    assert sliced.shape[0] * world == before.state_dict()["processor.processor.blocks.0.mlp.fc1.weight"].shape[0]
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_tensor_parallelize_slices_the_same_model(world):
    assert all(run_distributed(_sliced_state_dict_equals_full, world))


def _strategy_errors(rank, world):
    group = dist.group.WORLD
    plan = ModelShardPlan.build(_graph(False), group, processor_graph=False)
    for strategy in ("tensor", "shard_heads"):
        with pytest.raises(ValueError, match=rf"model.processor.shard_strategy='{strategy}' over a model group of 3 "
                                             r"ranks: .*num_heads=4 .*divisible by the .*group size 3"):
            check_parallel_strategy(_config("transformer", strategy, heads=4), plan)
    check_parallel_strategy(_config("transformer", "shard_sequence", heads=4), plan)  # any head count
    return True


def test_strategy_errors():
    with pytest.raises(ValueError, match="model.name='ensemble' supports processor.shard_strategy 'shard_sequence' or "
                                         "'shard_heads', not 'tensor'"):
        build_model(_config("ensemble", "tensor"), _graph(False), VARIABLES)
    assert all(run_distributed(_strategy_errors, 3))
