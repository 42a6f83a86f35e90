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
from stormshard.layers.tensor_parallel import TensorParallelTransformerBlock
from stormshard.layers.transformer import TransformerBlock, TransformerProcessor
from stormshard.models.config import ModelConfig, ProcessorConfig
from stormshard.models.encoder_processor_decoder import EncoderProcessorDecoder
from stormshard.models.ensemble import EnsembleEncoderProcessorDecoder
from stormshard.models.parallelize import (
    build_transformer_processor,
    check_parallel_strategy,
    parallelize,
    parallelize_processor,
)
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


def _config(name: str, checkpointing: bool = True, heads: int = 6) -> ModelConfig:
    return ModelConfig(name=name, num_channels=12, multistep_input=1, trainable_size=2,
                       processor=dict(num_layers=2, num_heads=heads, window_size=5, mlp_ratio=2),
                       encoder=dict(num_heads=2), decoder=dict(num_heads=2), activation_checkpointing=checkpointing)


def _unparallelized(config: ModelConfig, strategy: str, group) -> nn.Module:  # noqa: ANN001
    cls = EnsembleEncoderProcessorDecoder if config.name == "ensemble" else EncoderProcessorDecoder
    graph = _graph(config.uses_graph_processor)
    plan = ModelShardPlan.build(graph, group, processor_graph=config.uses_graph_processor, shard_strategy=strategy)
    return cls(config, graph, VARIABLES, plan)


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
    config = _config(name)
    torch.manual_seed(5)
    before = _unparallelized(config, strategy, None)
    torch.manual_seed(5)
    after = build_model(config, _graph(config.uses_graph_processor), VARIABLES, shard_strategy=strategy)
    assert after.plan.shard_strategy == strategy
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
    config = _config("transformer", heads=world * 2)
    torch.manual_seed(5)
    before = _unparallelized(config, "tensor", group)
    torch.manual_seed(5)
    after = build_model(config, _graph(False), VARIABLES, group, shard_strategy="tensor")
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
    for strategy in ("tensor", "shard_heads"):  # raised by build_model before anything is built
        with pytest.raises(ValueError, match=r"model.processor.num_heads=4 is not divisible by "
                                             rf"parallel.gpus_per_model=3: parallel.shard_strategy='{strategy}' splits"):
            build_model(_config("transformer", heads=4), _graph(False), VARIABLES, group, shard_strategy=strategy)
    plan = ModelShardPlan.build(_graph(False), group, processor_graph=False, shard_strategy="shard_heads")
    with pytest.raises(ValueError, match="model.processor.num_heads=4 is not divisible"):  # parallelize checks too
        parallelize(nn.Module(), _config("transformer", heads=4), plan)
    build_model(_config("transformer", heads=4), _graph(False), VARIABLES, group)  # shard_sequence: any head count
    return True


def test_strategy_errors():
    """One check (plan-free: no process group needed), naming parallel.shard_strategy, the value and the fix."""
    cases = [
        (_config("ensemble"), "tensor", 1, "parallel.shard_strategy='tensor' does not apply to model.name='ensemble'"),
        (_config("gnn"), "shard_heads", 1, "parallel.shard_strategy='shard_heads' applies to the sliding-window "
                                           "transformer processor only; model.name='gnn'"),
        (_config("graphtransformer"), "tensor", 2, "set parallel.shard_strategy='shard_sequence'"),
        (_config("transformer"), "ring", 1, r"parallel.shard_strategy='ring' is unknown: choose one of "
                                            r"\('shard_sequence', 'shard_heads', 'tensor'\)"),
        (_config("transformer", heads=4), "shard_heads", 3, "model.processor.num_heads=4 is not divisible by "
                                                             "parallel.gpus_per_model=3"),
        # unreachable through a validated config (heads divide the channels): built unvalidated
        (ModelConfig.model_construct(num_channels=9, processor=ProcessorConfig(num_heads=2, mlp_ratio=1)), "tensor",
         2, r"model.processor.mlp_ratio \* model.num_channels = 9 is not divisible by parallel.gpus_per_model=2"),
    ]
    for config, strategy, k, message in cases:
        with pytest.raises(ValueError, match=message):
            check_parallel_strategy(config, strategy, k)
    for strategy in ("shard_sequence", "shard_heads", "tensor"):
        check_parallel_strategy(_config("transformer"), strategy, 3)  # 6 heads, 24 MLP channels
    check_parallel_strategy(_config("gnn"), "shard_sequence", 5)
    with pytest.raises(ValueError, match="parallel.shard_strategy='tensor' does not apply to model.name='ensemble'"):
        build_model(_config("ensemble"), _graph(False), VARIABLES, shard_strategy="tensor")
    assert all(run_distributed(_strategy_errors, 3))
