"""Selective activation checkpointing (``model.activation_checkpointing: "selective"``) and checkpointed mappers
(``model.encoder`` / ``model.decoder.activation_checkpointing``).

- every processor kind (transformer, graph transformer, ensemble, GNN) with selective checkpointing
  gives the outputs and gradients of the model without checkpointing, float64, and its backward runs
  no attention forward again (the attention kernels run once per step; twice under full
  checkpointing), eager and compiled (``aot_eager`` and inductor);
- the sharded layouts (halo exchange, head all-to-all, tensor parallelism, graph halos) at 2, 3 and 4
  ranks: ``tests/test_attention.py`` and ``tests/test_models.py`` carry selective cases;
- a user's own attention operator is kept once registered (:func:`register_attention_op`);
- the encoder and decoder checkpointed (full or selective) equal the plain model, names unchanged, and the
  kernel setters reach wrapped blocks;
- the setting: its values, the error for any other, and the blocks it wraps.
"""

from __future__ import annotations

import functools
import re

import pytest
import torch
from torch import nn

from stormshard.graphs.builder import GraphConfig, KNNEdges, build_graph
from stormshard.kernels import banded, graph_csr
from stormshard.kernels.attention_ops import keeps_outputs, register_attention_op, registered_attention_ops
from stormshard.layers.checkpointing import ActivationCheckpoint, checkpoint_mode
from stormshard.models.config import ModelConfig
from stormshard.models.registry import build_model
from stormshard.models.variables import VariableIndex

VARIABLES = VariableIndex.build(["u", "v", "t", "insolation"], forcing=["insolation"])
CASES = {  # ModelConfig changes; the attention kernel each processor block runs
    "transformer": (dict(name="transformer"), "window"),
    "graphtransformer": (dict(name="graphtransformer", processor=dict(num_chunks=2)), "graph"),
    "ensemble": (dict(name="ensemble", ensemble=dict(noise_channels=2)), "window"),
    "gnn": (dict(name="gnn"), None),
}


@functools.lru_cache(maxsize=2)
def _graph(graph_processor: bool):
    if graph_processor:
        return build_graph(GraphConfig(data_grid="o4", hidden="ico1"))
    return build_graph(GraphConfig(data_grid="o4", hidden="o2", processor=KNNEdges(num_neighbours=4)))


def _model(case: str, checkpointing: bool | str) -> nn.Module:
    spec = dict(CASES[case][0])
    processor = dict(num_layers=2, num_heads=2, window_size=9, mlp_ratio=2, **spec.pop("processor", {}))
    config = ModelConfig(num_channels=8, multistep_input=2, trainable_size=3, processor=processor,
                         encoder=dict(num_heads=2), decoder=dict(num_heads=2), activation_checkpointing=checkpointing,
                         **spec)
    torch.manual_seed(0)
    return build_model(config, _graph(config.uses_graph_processor), VARIABLES).double()


@pytest.fixture
def kernel_calls(monkeypatch) -> dict[str, int]:
    """Counts of the window and graph attention kernels' forwards (every path reaches these functions)."""
    calls = {"window": 0, "graph": 0}

    def counted(kind, fn):  # noqa: ANN001, ANN202
        def run(*args):  # noqa: ANN002, ANN202
            calls[kind] += 1
            return fn(*args)
        return run

    monkeypatch.setattr(banded, "_banded_forward", counted("window", banded._banded_forward))
    monkeypatch.setattr(graph_csr, "_forward_outputs", counted("graph", graph_csr._forward_outputs))
    return calls


def _step(model: nn.Module, case: str, calls: dict[str, int]) -> tuple[torch.Tensor, dict, int]:
    """Output, parameter gradients and the processor's attention forwards of one forward + backward."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 2, model.plan.data_sizes[0], len(VARIABLES.input_names), generator=g, dtype=torch.float64)
    args = (x,) if case != "ensemble" else (x, torch.randn(2, model.plan.hidden_sizes[0], 2, generator=g,
                                                            dtype=torch.float64))
    model.zero_grad()
    kind = CASES[case][1]
    before = calls[kind] if kind else 0
    out = model(*args)
    (out * torch.linspace(-1, 1, out.shape[-1], dtype=out.dtype)).square().sum().backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, (calls[kind] - before if kind else 0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_selective_equals_no_checkpointing_and_skips_the_attention_recompute(case, kernel_calls):
    plain, full, selective = (_step(_model(case, mode), case, kernel_calls) for mode in (False, True, "selective"))
    for name, result in (("full", full), ("selective", selective)):
        torch.testing.assert_close(result[0], plain[0], rtol=1e-13, atol=1e-13, msg=lambda m, n=name: f"{n}: {m}")
        assert result[1].keys() == plain[1].keys()
        for p in plain[1]:
            torch.testing.assert_close(result[1][p], plain[1][p], rtol=1e-12, atol=1e-13,
                                       msg=lambda m, n=name, p=p: f"{n}, {p}: {m}")
    kind = CASES[case][1]
    if kind is None:  # a GNN processor has no attention operator: selective recomputes everything, as full
        return
    # the mappers' graph attention runs as often in every mode (they are not checkpointed); the two processor
    # layers' attention runs again in the backward under full checkpointing, not under selective
    assert full[2] == plain[2] + 2
    assert selective[2] == plain[2]


@pytest.mark.parametrize("backend,case", [("aot_eager", "transformer"), ("inductor", "transformer"),
                                          ("aot_eager", "graphtransformer")])
def test_compiled_selective_blocks_keep_the_attention_output(backend, case, kernel_calls, monkeypatch):
    """A compiled checkpointed block recomputes its products and norms and takes the attention output it kept:
    the attention kernels run as often as in the model without checkpointing (the processor's twice as often
    under full checkpointing), and the step equals eager's."""
    from stormshard.models.compile import BACKEND_VARIABLE, compile_blocks

    monkeypatch.setenv(BACKEND_VARIABLE, backend)
    torch._dynamo.reset()
    try:
        plain = _step(_model(case, False), case, kernel_calls)
        results = {}
        for mode in (True, "selective") if backend == "aot_eager" else ("selective",):  # inductor: 20 s a model
            model = _model(case, mode)
            compile_blocks(model)
            _step(model, case, kernel_calls)  # compiles
            results[mode] = _step(model, case, kernel_calls)
    finally:
        torch._dynamo.reset()
    for mode, result in results.items():
        torch.testing.assert_close(result[0], plain[0], rtol=1e-12, atol=1e-12)
        for p in plain[1]:
            torch.testing.assert_close(result[1][p], plain[1][p], rtol=1e-11, atol=1e-12,
                                       msg=lambda m, p=p, mode=mode: f"{mode}, {p}: {m}")
    # each attention forward at most as often as without checkpointing (the graph processor's edge chunks checkpoint
    # themselves: torch 2.11's partitioner lets their recompute take the kept outputs too, 2.13's runs it again)
    assert results["selective"][2] == plain[2] if case == "transformer" else results["selective"][2] <= plain[2]
    if True in results and case == "transformer":  # full: the two processor layers' window attention again (a
        # compiled graph block's full checkpointing may keep its attention op's outputs: the partitioner's choice)
        assert results[True][2] == plain[2] + 2


@torch.library.custom_op("stormshard_test::scaled_mix", mutates_args=())
def _scaled_mix(x: torch.Tensor, scale: float) -> torch.Tensor:
    _MIX_CALLS.append(1)
    return torch.softmax(x * scale, dim=-1) * x


_MIX_CALLS: list[int] = []
_scaled_mix.register_fake(lambda x, scale: torch.empty_like(x))


def _mix_setup(ctx, inputs, output):  # noqa: ANN001, ANN202
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


def _mix_backward(ctx, grad):  # noqa: ANN001, ANN202
    (x,) = ctx.saved_tensors
    with torch.enable_grad():
        x = x.detach().requires_grad_()
        out = torch.softmax(x * ctx.scale, dim=-1) * x
        return torch.autograd.grad(out, x, grad)[0], None


_scaled_mix.register_autograd(_mix_backward, setup_context=_mix_setup)


class _UserBlock(nn.Module):
    """A block of a user's architecture around their own attention operator."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(6, 6, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.ops.stormshard_test.scaled_mix(self.inner(x), 0.5)


def test_a_registered_user_operator_is_kept():
    torch.manual_seed(0)
    block = _UserBlock()
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    reference = torch.autograd.grad(block(x).square().sum(), [x, *block.parameters()])
    wrapped = ActivationCheckpoint(block, "selective")
    counts = []
    for _ in ("before", "after"):
        _MIX_CALLS.clear()
        grads = torch.autograd.grad(wrapped(x).square().sum(), [x, *block.parameters()])
        counts.append(len(_MIX_CALLS))
        for a, b in zip(grads, reference, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)
        if not keeps_outputs(torch.ops.stormshard_test.scaled_mix.default):
            assert register_attention_op(_scaled_mix) == "stormshard_test::scaled_mix"
    assert counts == [2, 1]  # recomputed until registered, kept after
    assert keeps_outputs(torch.ops.stormshard_test.scaled_mix.default)
    assert "stormshard_test::scaled_mix" in registered_attention_ops()
    assert register_attention_op("stormshard_test::other") == "stormshard_test::other"
    with pytest.raises(TypeError, match="needs a torch operator .* or its schema name 'namespace::name', got 'mix'"):
        register_attention_op("mix")
    with pytest.raises(TypeError, match="needs a torch operator"):
        register_attention_op(len)


def test_the_built_in_attention_operators():
    from torch._higher_order_ops.flex_attention import flex_attention

    import stormshard.kernels.graph_triton  # noqa: F401 - registers its op where Triton imports or not

    for op in (torch.ops.stormshard.banded_window_attention.default, torch.ops.stormshard.fused_graph_attention,
               torch.ops.stormshard.triton_graph_attention.default, flex_attention,
               torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert keeps_outputs(op), op
    for op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.native_layer_norm.default,
               torch.ops.stormshard.banded_window_attention_backward.default, torch.ops.higher_order.cond):
        assert not keeps_outputs(op), op


def test_the_setting():
    assert [checkpoint_mode(v) for v in (False, True, "full", "selective")] == [None, "full", "full", "selective"]
    for value in (False, True, "full", "selective"):
        assert ModelConfig(activation_checkpointing=value).activation_checkpointing == value
    for bad in ("partial", "true", 1, None):
        with pytest.raises(ValueError, match=r"activation_checkpointing\n.*is " + re.escape(repr(bad))
                           + r": use false, true \(or 'full': recompute the blocks in backward\) or 'selective'"):
            ModelConfig(activation_checkpointing=bad)
    model = _model("transformer", "selective")
    assert [type(b).__name__ for b in model.processor.blocks] == ["ActivationCheckpoint"] * 2
    assert {b.mode for b in model.processor.blocks} == {"selective"}
    assert {b.mode for b in _model("transformer", "full").processor.blocks} == {"full"}
    assert repr(model.processor.blocks[0]).splitlines()[:2] == ["ActivationCheckpoint[TransformerBlock](",
                                                                 "  mode=selective"]
    with pytest.raises(ValueError, match=r"mode must be one of \('full', 'selective'\), got 'some'"):
        ActivationCheckpoint(nn.Linear(2, 2), "some")


@pytest.mark.parametrize("case", ["transformer", "graphtransformer", "gnn"])
def test_checkpointed_mappers_equal_the_plain_model(case, kernel_calls):
    """``model.encoder`` / ``model.decoder.activation_checkpointing``: the mappers wrapped (names unchanged),
    the outputs and gradients of the plain model; selective keeps the encoder's graph attention output."""
    spec = dict(CASES[case][0])
    processor = dict(num_layers=2, num_heads=2, window_size=9, mlp_ratio=2, **spec.pop("processor", {}))
    results = {}
    for encoder, decoder in ((False, False), ("selective", True), (True, "selective")):
        config = ModelConfig(num_channels=8, multistep_input=2, trainable_size=3, processor=processor,
                             encoder=dict(num_heads=2, activation_checkpointing=encoder),
                             decoder=dict(num_heads=2, activation_checkpointing=decoder), **spec)
        torch.manual_seed(0)
        model = build_model(config, _graph(config.uses_graph_processor), VARIABLES).double()
        if encoder:
            assert isinstance(model.encoder, ActivationCheckpoint) and model.encoder.mode == checkpoint_mode(encoder)
            assert isinstance(model.decoder, ActivationCheckpoint) and model.decoder.mode == checkpoint_mode(decoder)
        before = kernel_calls["graph"]
        results[encoder, decoder] = (*_step(model, case, kernel_calls)[:2], kernel_calls["graph"] - before,
                                     sorted(model.state_dict()))
    plain = results[False, False]
    for result in results.values():
        torch.testing.assert_close(result[0], plain[0], rtol=1e-13, atol=1e-13)
        for p in plain[1]:
            torch.testing.assert_close(result[1][p], plain[1][p], rtol=1e-12, atol=1e-13, msg=lambda m, p=p: f"{p}: {m}")
        assert result[3] == plain[3]  # state-dict names unchanged
    if case != "gnn":  # one graph attention more: the fully checkpointed mapper's, recomputed
        assert results["selective", True][2] == results[True, "selective"][2] == plain[2] + 1


def test_kernel_setters_reach_checkpointed_blocks():
    """set_graph_kernel switches wrapped blocks too (processor blocks and mappers inside ActivationCheckpoint)."""
    from stormshard.layers.checkpointing import unwrapped_modules
    from stormshard.layers.graph_transformer import _GraphTransformerBase, set_graph_kernel

    config = ModelConfig(name="graphtransformer", num_channels=8, processor=dict(num_layers=2, num_heads=2),
                         encoder=dict(num_heads=2, activation_checkpointing="selective"), decoder=dict(num_heads=2),
                         activation_checkpointing=True)
    model = build_model(config, _graph(True), VARIABLES)
    assert set_graph_kernel(model, "csr") == 4  # encoder, two processor blocks, decoder
    assert [m.graph_kernel for m in unwrapped_modules(model) if isinstance(m, _GraphTransformerBase)] == ["csr"] * 4


def test_mapper_checkpointing_errors():
    from stormshard.models.parallelize import checkpoint_mapper

    with pytest.raises(ValueError, match=r"encoder.activation_checkpointing\n.*is 'sometimes': use false"):
        ModelConfig(encoder=dict(activation_checkpointing="sometimes"))
    with pytest.raises(ValueError, match=r"model.decoder.activation_checkpointing is \"selective\" but the model has no "
                                         r"decoder module to checkpoint"):
        checkpoint_mapper(nn.Sequential(), "decoder", "selective")
    model = _model("transformer", False)
    checkpoint_mapper(model, "encoder", True)
    wrapped = model.encoder
    checkpoint_mapper(model, "encoder", "selective")  # already wrapped: left as it is
    assert model.encoder is wrapped and wrapped.mode == "full"
