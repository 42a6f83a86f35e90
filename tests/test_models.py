"""The model zoo: every processor and strategy gives the same outputs and gradients at
gpus_per_model 1, 2, 3 and 4 (uneven grid and hidden slices, batch 2), float64."""

from __future__ import annotations

import contextlib
import functools
import importlib.util

import pytest
import torch
import torch.distributed as dist

from stormshard.graphs.builder import GraphConfig, KNNEdges, TruncationGrid, build_graph
from stormshard.layers.checkpointing import ActivationCheckpoint
from stormshard.models.config import ModelConfig
from stormshard.models.registry import build_model
from stormshard.models.variables import VariableIndex
from stormshard.parallel.comm import all_reduce_sum
from stormshard.parallel.partition import get_partition
from stormshard.training.losses import AlmostFairCRPSLoss, WeightedMSELoss
from tests.distributed import run_distributed
from tests.test_graph_layers import force_lean_paths

VARIABLES = VariableIndex.build(["u", "v", "t", "insolation", "precip"], forcing=["insolation"], diagnostic=["precip"])

CASES = {  # ModelConfig fields, plus "strategy": the build_model shard_strategy (parallel.shard_strategy)
    "transformer-shard_sequence": dict(name="transformer", strategy="shard_sequence"),
    "transformer-shard_heads": dict(name="transformer", strategy="shard_heads"),
    "transformer-tensor": dict(name="transformer", strategy="tensor"),
    "graphtransformer": dict(name="graphtransformer", processor=dict(num_chunks=2)),
    "gnn": dict(name="gnn"),
    "ensemble": dict(name="ensemble", ensemble=dict(noise_channels=3)),
    "transformer-checkpointed": dict(name="transformer", activation_checkpointing=True),
    "gnn-checkpointed": dict(name="gnn", activation_checkpointing=True, processor=dict(num_chunks=3)),
    # selective checkpointing (the attention outputs kept): tensor-parallel blocks, graph-processor chunks
    "transformer-tensor-selective": dict(name="transformer", strategy="tensor", activation_checkpointing="selective"),
    "graphtransformer-selective": dict(name="graphtransformer", activation_checkpointing="selective",
                                       processor=dict(num_chunks=2)),
    # checkpointed mappers: the encoder's and decoder's graph halos recomputed in the backward
    "transformer-mappers-checkpointed": dict(name="transformer", strategy="shard_heads",
                                             encoder=dict(activation_checkpointing="selective"),
                                             decoder=dict(activation_checkpointing=True)),
    # anemoi's AIFS features (an imported anemoi model): trainable edge features, latent skip, the
    # decoder's own input embedding, ReLU bounding of an output
    "graphtransformer-anemoi": dict(name="graphtransformer", latent_skip=True, decoder_embedding=True,
                                    relu_bounded=("precip",),
                                    bounding=(dict(kind="hardtanh", variables=("t",), min_val=-0.5, max_val=0.5),
                                              dict(kind="leaky_fraction", variables=("v",), min_val=0.0, max_val=1.0,
                                                   total_variable="precip"),
                                              dict(kind="normalized_relu", variables=("u",), thresholds=(-0.2,))),
                                    processor=dict(num_chunks=2, self_projection=True, trainable_edge_size=2),
                                    encoder=dict(self_projection=True, trainable_edge_size=3),
                                    decoder=dict(self_projection=True, trainable_edge_size=2)),
    "transformer-anemoi": dict(name="transformer", latent_skip=True, decoder_embedding=True, relu_bounded=("u",),
                               encoder=dict(trainable_edge_size=2), decoder=dict(trainable_edge_size=1)),
    # anemoi's GNN model (GNNForwardMapper, GNNProcessor, GNNBackwardMapper): MLP node embeddings, edge-embedding
    # MLPs (the processor's in its first block), updated edges aggregated, deeper MLPs (anemoi's mlp_extra_layers),
    # the edge MLP at ratio 1, the encoder's update of the data latents the decoder reads, the MLP head, trainable
    # node and edge tensors, latent skip, ReLU bounding; the processor's edges in 2 chunks
    "gnn-anemoi": dict(name="gnn", node_embedding="mlp", head="mlp", latent_skip=True, relu_bounded=("precip",),
                       processor=dict(num_chunks=2, mlp_hidden_layers=2, edge_embedding=True,
                                      aggregate_updated_edges=True, edge_mlp_ratio=1.0, trainable_edge_size=2),
                       encoder=dict(mlp_hidden_layers=3, edge_embedding=True,
                                    aggregate_updated_edges=True, edge_mlp_ratio=1.0, update_src_nodes=True,
                                    trainable_edge_size=3),
                       decoder=dict(mlp_hidden_layers=2, edge_embedding=True,
                                    aggregate_updated_edges=True, edge_mlp_ratio=1.0, trainable_edge_size=2)),
    # anemoi's TruncatedConnection: the last input state through the graph's truncation grid (o2) and back
    "transformer-truncated": dict(name="transformer", residual="truncated"),
    # anemoi's qk_norm (per head over head_dim 4: 48 channels, 12 heads) and gated MLPs (mlp_implementation) at
    # fractional ratios, in the processor (every strategy: halo, head all-to-all, tensor with fc1's interleaved
    # gate / value rows sliced over 2-4 ranks: 84 hidden channels) and the mappers
    **{f"transformer-qk-gated-{strategy}": dict(
        name="transformer", strategy=strategy, num_channels=48,
        processor=dict(qk_norm=True, mlp_implementation="swiglu", mlp_ratio=1.75),
        encoder=dict(qk_norm=True, mlp_implementation="geglu", mlp_ratio=1.5),
        decoder=dict(mlp_implementation="glu")) for strategy in ("shard_sequence", "shard_heads", "tensor")},
    "graphtransformer-qk-gated": dict(name="graphtransformer", num_channels=48,
                                      processor=dict(num_chunks=2, qk_norm=True, mlp_implementation="reglu",
                                                     mlp_ratio=1.25, self_projection=True),
                                      encoder=dict(qk_norm=True, mlp_implementation="swiglu", mlp_ratio=2.5),
                                      decoder=dict(qk_norm=True, mlp_implementation="geglu")),
    # anemoi's ensemble model (AnemoiEnsModelEncProcDec): its noise MLP (the norms conditioned on the 3 noise
    # channels), the fcstep input (step 1 here: the channel is 1) and the residual's prognostic variables as data-node
    # inputs, through the truncated residual (which communicates), latent skip, decoder embedding, trainable edges,
    # query / key norms
    "ensemble-anemoi": dict(name="ensemble", latent_skip=True, decoder_embedding=True, residual="truncated",
                            relu_bounded=("u",), ensemble=dict(noise_channels=3, noise_embedding="anemoi",
                                                               noise_mlp_hidden=5, fcstep_input=True,
                                                               condition_on_residual=True),
                            processor=dict(qk_norm=True), encoder=dict(trainable_edge_size=2),
                            decoder=dict(trainable_edge_size=1)),
    "ensemble-qk-gated": dict(name="ensemble", strategy="shard_heads", ensemble=dict(noise_channels=3),
                              processor=dict(qk_norm=True, mlp_implementation="glu")),
    # the Triton graph kernel (Triton's interpreter on a CPU) in encoder, processor and decoder, against the
    # csr kernel's single-process model; trainable edge features give the attribute gradients a path
    # (small: the interpreter runs every Triton program, one per node, head group and batch entry, in numpy; o1
    # data (40 nodes: 20 / 14, 13, 13 / 10 per rank, uneven at 3 ranks as O2's 88), ico0 hidden, one processor block)
    "graphtransformer-triton": dict(name="graphtransformer", graph_kernel="triton",
                                    processor=dict(num_layers=1, num_chunks=2, self_projection=True,
                                                   trainable_edge_size=2),
                                    encoder=dict(num_chunks=2, trainable_edge_size=3),
                                    decoder=dict(trainable_edge_size=2)),
}
# the memory-lean paths (stormshard.layers.norm_linear, row_chunked_mlp) forced on at these small sizes in the
# sharded model, against the plain single-process model: the norms inside the projections (the decoder's and the
# head's), the MLPs in 5-row chunks with their norm inside
LEAN = {"graphtransformer-lean": "graphtransformer", "transformer-anemoi-lean": "transformer-anemoi",
        "graphtransformer-qk-gated-lean": "graphtransformer-qk-gated"}
CASES.update({lean: CASES[base] for lean, base in LEAN.items()})
HAS_TRITON = importlib.util.find_spec("triton") is not None


def _cases(names: list[str]) -> list:
    """``names`` as pytest params; the Triton case skips where Triton is not installed."""
    skip = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
    return [pytest.param(n, marks=skip) if "triton" in n else n for n in names]


@functools.lru_cache(maxsize=4)
def _graph(graph_processor: bool, small: bool = False, truncated: bool = False):
    if small:  # the Triton case: 40 data nodes (encoder destinations have 4-5 edges, decoder sources 7-12)
        cfg = GraphConfig(data_grid="o1", hidden="ico0")
    elif graph_processor:
        cfg = GraphConfig(data_grid="o4", hidden="ico1")
    else:
        cfg = GraphConfig(data_grid="o4", hidden="o2", processor=KNNEdges(num_neighbours=4))
    if truncated:
        cfg = cfg.model_copy(update={"truncation": TruncationGrid(grid="o2", sigma=0.3)})
    return build_graph(cfg)


def _config(case: str) -> tuple[ModelConfig, str]:
    """The case's model config and shard strategy."""
    spec = dict(CASES[case])
    strategy = spec.pop("strategy", "shard_sequence")
    proc = dict(num_layers=2, num_heads=12, window_size=9, mlp_ratio=2)
    proc.update(spec.pop("processor", {}))
    encoder = dict(num_heads=2, mlp_ratio=2.0) | spec.pop("encoder", {})
    decoder = dict(num_heads=2, mlp_ratio=1.0) | spec.pop("decoder", {})
    config = ModelConfig(num_channels=spec.pop("num_channels", 24), multistep_input=2, trainable_size=3, processor=proc,
                         encoder=encoder, decoder=decoder, **spec)
    return config, strategy


def _run(model, x, noise):
    return model(x, noise, step=1) if noise is not None else model(x)


# At world 1 a case is compared with an independent computation of the same model: no activation
# checkpointing, one edge chunk, and the shard_sequence processor in place of shard_heads / tensor
# (all strategies share parameter names, shapes and initialisation). Cases that are already that
# reference have no world-1 test: their reference is what the 2-4 rank tests compare against.
def _reference_case(config: ModelConfig, strategy: str, world: int) -> tuple[ModelConfig, str]:
    if config.graph_kernel != "auto":  # another graph kernel: the reference is the csr kernel's model
        config = config.model_copy(update={"graph_kernel": "csr"})
        if world > 1:
            return config, strategy
    if world > 1:
        return config, strategy
    processor = config.processor.model_copy(update={"num_chunks": 1})
    return ModelConfig(**{**config.model_dump(), "activation_checkpointing": False,
                          "processor": processor.model_dump()}), "shard_sequence"


def _world_one_differs(case: str) -> bool:
    config, strategy = _config(case)
    ref_config, ref_strategy = _reference_case(config, strategy, 1)
    return (ref_config.model_dump(), ref_strategy) != (config.model_dump(), strategy)


def _head_groups(config: ModelConfig):  # noqa: ANN202 - a context manager
    """The Triton case runs its kernels with 8 heads per program: the processor's 12 heads in 2 programs per
    node, the second group half empty (its own tiles would take them in one at this head size), so sharding
    meets the head groups; and 4-edge tiles, so that the O1 graph's nodes with 5 edges (encoder destinations,
    every processor node) and the decoder's sources (7-12 edges) walk more than one tile."""
    if config.graph_kernel != "triton":
        return contextlib.nullcontext()
    from stormshard.kernels.graph_triton import Tiles, tile_override

    return tile_override(Tiles(heads_per_program=8, block_e=4, num_warps=2))


def _selective(config: ModelConfig) -> bool:
    return "selective" in (config.activation_checkpointing, config.encoder.activation_checkpointing,
                           config.decoder.activation_checkpointing)


def _check_model(rank, world, case):
    config, strategy = _config(case)
    graph = _graph(config.uses_graph_processor, small=config.graph_kernel == "triton",
                   truncated=config.residual == "truncated")
    group = dist.group.WORLD if world > 1 else None
    ref_config, ref_strategy = _reference_case(config, strategy, world)
    torch.manual_seed(7)
    reference = build_model(ref_config, graph, VARIABLES, None, shard_strategy=ref_strategy).double()
    torch.manual_seed(7)
    sharded = build_model(config, graph, VARIABLES, group, shard_strategy=strategy).double()

    if config.name == "ensemble":  # the conditional norms start at zero (noise-blind): give the noise a path
        for model in (reference, sharded):
            gen = torch.Generator().manual_seed(5)
            for name, p in model.named_parameters():
                if "scale_shift" in name:
                    with torch.no_grad():
                        p.copy_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    g = torch.Generator().manual_seed(3)
    n_data = graph["data"].num_nodes
    x = torch.randn(2, 2, n_data, len(VARIABLES.input_names), generator=g, dtype=torch.float64)
    target = torch.randn(2, n_data, len(VARIABLES.output_names), generator=g, dtype=torch.float64)
    area = graph["data"].area_weight.double()
    vw = torch.tensor([1.0, 0.5, 2.0, 0.3], dtype=torch.float64)
    noise_full = None
    if config.name == "ensemble":
        noise_full = torch.randn(2, graph["hidden"].num_nodes, 3, generator=g, dtype=torch.float64)

    ds = sharded.plan.data_slice
    loss_fn = AlmostFairCRPSLoss(vw) if config.name == "ensemble" else WeightedMSELoss(vw)

    def loss_of(out, tgt, a, grp):
        if config.name == "ensemble":  # the batch entries are two members of one initial state
            return loss_fn(out.unsqueeze(0), tgt[:1], a, grp)
        return loss_fn(out, tgt, a, grp)

    ref_out = _run(reference, x, noise_full)
    loss_of(ref_out, target, area, None).backward()

    noise = None if noise_full is None else noise_full[:, sharded.plan.hidden_slice]
    if case in LEAN:
        force_lean_paths(sharded)
    with _head_groups(config):
        if _selective(config):  # a first, watched step; the checked one keeps the kernels' outputs without a mode
            loss_of(_run(sharded, x[:, :, ds], noise), target[:, ds], area[ds], group).backward()
            sharded.zero_grad(set_to_none=True)
            assert all(m.keeps_own_outputs() for m in sharded.modules()
                       if isinstance(m, ActivationCheckpoint) and m.mode == "selective")
        out = _run(sharded, x[:, :, ds], noise)
        loss = loss_of(out, target[:, ds], area[ds], group)
        loss.backward()

    torch.testing.assert_close(out, ref_out[:, ds].detach(), rtol=1e-10, atol=1e-10)
    ref_params = dict(reference.named_parameters())
    for name, p in sharded.named_parameters():
        ref = ref_params[name]
        part = get_partition(p)
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        if part is None:  # replicated: partial gradients sum over the model group
            grad = all_reduce_sum(grad, group)
            torch.testing.assert_close(p.detach(), ref.detach(), rtol=0, atol=0, msg=f"init {name}")
            ref_grad = ref.grad
        else:
            ref_grad = ref.grad.narrow(part.dim, part.offset, p.shape[part.dim])
            torch.testing.assert_close(p.detach(), ref.detach().narrow(part.dim, part.offset, p.shape[part.dim]))
        assert ref_grad is not None, name
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-11, msg=f"gradient of {name}")
    return True


@pytest.mark.parametrize("case", _cases(list(CASES)))
@pytest.mark.parametrize("world", [2, 3, 4])
def test_model_layouts_equal_single_process(case, world):
    run_distributed(_check_model, world, case)


@pytest.mark.parametrize("case", _cases([c for c in CASES if _world_one_differs(c)]))
def test_model_equals_reference_variant_at_world_1(case):
    """Checkpointing, edge chunks and the processor strategy do not change the single-process model."""
    _check_model(0, 1, case)


def test_config_errors():
    with pytest.raises(ValueError, match="num_channels=10 is not divisible by processor.num_heads=4"):
        ModelConfig(num_channels=10, processor=dict(num_heads=4))
    with pytest.raises(ValueError, match="extra_forbidden|Extra inputs"):
        ModelConfig(num_chanels=16)
    with pytest.raises(ValueError, match="extra_forbidden|Extra inputs"):  # a parallel setting, not a model one
        ModelConfig(processor=dict(shard_strategy="tensor"))
    with pytest.raises(ValueError, match="forcing variables \\['w'\\] are not in"):
        VariableIndex.build(["u"], forcing=["w"])


def test_gnn_option_errors_name_the_field_value_and_fix():
    """anemoi's GNN options (model.name "gnn" only) in combinations that cannot build: config errors."""
    cases = [
        (dict(name="graphtransformer", head="mlp"), r"model.head='mlp' is set but model.name='graphtransformer': drop"),
        (dict(name="transformer", node_embedding="mlp"), r"model.node_embedding='mlp' is set but model.name="),
        (dict(name="graphtransformer", processor=dict(edge_embedding=True)),
         r"model.processor.edge_embedding=True is set but model.name='graphtransformer'"),
        (dict(name="transformer", encoder=dict(mlp_hidden_layers=2)), r"model.encoder.mlp_hidden_layers=2 is set"),
        (dict(name="gnn", decoder=dict(update_src_nodes=True)), r"model.decoder.update_src_nodes=True: .* set "
                                                                 r"model.encoder.update_src_nodes"),
        (dict(name="gnn", encoder=dict(update_src_nodes=True)),
         r"model.encoder.update_src_nodes=True needs model.encoder.edge_embedding=True"),
        (dict(name="gnn", decoder_embedding=True, encoder=dict(update_src_nodes=True, edge_embedding=True)),
         r"update_src_nodes=True with model.decoder_embedding=True: .* drop one of them"),
        (dict(name="gnn", processor=dict(edge_mlp_ratio=0)), r"processor.edge_mlp_ratio"),
    ]
    for fields, message in cases:
        with pytest.raises(ValueError, match=message):
            ModelConfig(**fields)
    assert ModelConfig(name="gnn").head == "norm_linear"  # defaults off: the interaction network as before


def test_bad_input_shape():
    config, _ = _config("transformer-shard_sequence")
    model = build_model(config, _graph(False), VARIABLES)
    with pytest.raises(ValueError, match="model input has shape"):
        model(torch.zeros(1, 3, 208, 4))


# ------------------------------------------------------------------------------------------
# model.name: built-ins, registered names, "package.module:attribute" builders; model.options
# ------------------------------------------------------------------------------------------


def test_model_name_errors_name_the_field_value_and_fix():
    """The config checks the name's form and imports nothing; the registry resolves it (at build)."""
    from stormshard.models.registry import resolve_builder

    cases = [
        ("transfomer", r"model.name='transfomer' is unknown: name a registered model \(\['ensemble', 'gnn', "
                       r"'graphtransformer', 'transformer'.*'package.module:function'"),
        ("no_such_pkg.models:build", r"model.name='no_such_pkg.models:build': module 'no_such_pkg.models' cannot "
                                     r"be imported \(No module named 'no_such_pkg'\): put it on PYTHONPATH"),
        ("examples.custom_architecture:buld", "module 'examples.custom_architecture' has no attribute 'buld'"),
        ("examples.custom_architecture:WORLD", "names a value of type int, not a callable"),
        ("examples.custom_architecture:GridOptions.from_config", r"cannot be called as builder\(config, graph, "
                                                                  r"variables, plan\)"),
        (":build", "is not 'package.module:attribute'"),
    ]
    for name, message in cases:
        with pytest.raises(ValueError, match=message):
            resolve_builder(ModelConfig(name=name).name)
    for name in (":build", "pkg.mod:", "a b:c", "pkg:mod:build", ""):
        with pytest.raises(ValueError, match=f"model.name={name!r} is (not 'package.module:attribute'|empty)"):
            ModelConfig(name=name)
    assert ModelConfig(name="no_such_pkg.models:build").name == "no_such_pkg.models:build"  # nothing imported


def test_custom_builder_from_config_and_options():
    from stormshard.models.registry import MODEL_REGISTRY, register_model, resolve_builder

    config = ModelConfig(name="examples.custom_architecture:build", num_channels=8,
                         options={"num_layers": 1, "num_heads": 2, "window_size": 3})
    assert config.options == {"num_layers": 1, "num_heads": 2, "window_size": 3} and not config.is_builtin
    assert ModelConfig(**config.model_dump()) == config  # round-trips (checkpoints store model_dump())
    model = build_model(config, _graph(False), VARIABLES)
    assert model.plan.shard_strategy == "shard_sequence" and model.plan.world == 1
    n = _graph(False)["data"].num_nodes
    assert model(torch.zeros(2, 2, n, len(VARIABLES.input_names))).shape == (2, n, len(VARIABLES.output_names))
    with pytest.raises(ValueError, match=r"model.options has unknown keys \['depth'\]"):
        build_model(ModelConfig(name=config.name, options={"depth": 2}), _graph(False), VARIABLES)
    # a built-in's size checks do not apply to a custom builder (10 channels, 4 default processor heads)
    ModelConfig(name=config.name, num_channels=10)
    with pytest.raises(ValueError, match=r"model.options=\{'num_layers': 1\} is given but model.name='gnn' is a "
                                         "built-in model"):
        ModelConfig(name="gnn", options={"num_layers": 1})
    with pytest.raises(ValueError, match="model.options must be JSON-serialisable"):
        ModelConfig(name=config.name, options={"x": float("nan")})

    name = "test_models_registered"
    if name not in MODEL_REGISTRY:
        register_model(name)(resolve_builder(config.name))
    assert ModelConfig(name=name).name == name
    with pytest.raises(ValueError, match="is registered already"):
        register_model(name)(resolve_builder(config.name))
    with pytest.raises(ValueError, match="contains ':'"):
        register_model("a:b")
