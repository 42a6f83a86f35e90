"""Model configuration (pydantic): sizes validated up front, unknown keys rejected.

JSON example (the ``model`` section of an experiment config)::

    {"name": "transformer", "num_channels": 128, "multistep_input": 2, "trainable_size": 8,
     "processor": {"num_layers": 4, "num_heads": 8, "window_size": 64},
     "encoder": {"num_heads": 8}, "decoder": {"num_heads": 8}, "activation_checkpointing": false}

``name`` is a built-in model (:data:`BUILTIN_MODELS`), a name added with
:func:`~stormshard.models.registry.register_model`, or ``"package.module:attribute"``: a builder
of the user's own (:data:`~stormshard.models.registry.ModelBuilder` signature). Validating checks
only the name's form (:func:`builder_module`) and imports nothing: the registry resolves the name
when the model is built (:func:`~stormshard.models.registry.resolve_builder`), and a name that a
stored file gives is imported only when the user trusts it (:mod:`stormshard.models.trust`);
``options`` (a free JSON object) reaches that builder as ``config.options``.
How the processor is split over the model group (``shard_strategy``) is a parallel setting, not a
model one: it reaches the model through :class:`~stormshard.models.sharding.ModelShardPlan`.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stormshard.kernels.names import AttentionKernel, GraphKernel
from stormshard.layers.mlp_kinds import MLPKind

__all__ = ["ProcessorConfig", "MapperConfig", "BoundingConfig", "EnsembleConfig", "ModelConfig", "BUILTIN_MODELS",
           "builder_module"]

#: The models stormshard builds itself (the encoder-processor-decoder family).
BUILTIN_MODELS: tuple[str, ...] = ("transformer", "graphtransformer", "gnn", "ensemble")

_DOTTED = r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*"
_BUILDER_NAME = re.compile(rf"{_DOTTED}:{_DOTTED}", re.ASCII)


def builder_module(name: str) -> str | None:
    """The module a ``"package.module:attribute"`` model name names (None for a built-in or registered
    name: those hold no ':'); ValueError naming ``model.name`` when the form is wrong. Imports nothing."""
    if ":" not in name:
        return None
    if not _BUILDER_NAME.fullmatch(name):
        raise ValueError(
            f"model.name={name!r} is not 'package.module:attribute' (dotted Python names on both sides of one ':'): "
            f"name a built-in model {list(BUILTIN_MODELS)}, one added with register_model, or your own builder as "
            "'package.module:function'"
        )
    return name.partition(":")[0]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


#: the GNN options' descriptions (processor, encoder and decoder sections; model.name "gnn" only)
_MLP_LAYERS = ("gnn: (Linear, GELU) pairs before each MLP's output Linear (1: Linear, GELU, Linear, LayerNorm); "
               "anemoi's mlp_extra_layers + 2")
_EDGE_EMBEDDING = ("gnn: embed the edge attributes (trainable ones included) to num_channels with an MLP before the "
                   "message passing (anemoi's emb_edges)")
_AGGREGATE = "gnn: sum the updated edges e + m into each node instead of the messages m (anemoi's GraphConv)"
_EDGE_MLP_RATIO = ("gnn: the edge MLP's hidden width over its edge channels (null: mlp_ratio); anemoi's GraphConv "
                   "keeps 1 whatever its mlp_hidden_ratio")
#: the gnn-only fields of a section, with their defaults (a non-default value elsewhere is a config error)
_GNN_FIELDS = {"mlp_hidden_layers": 1, "edge_embedding": False, "aggregate_updated_edges": False,
               "edge_mlp_ratio": None}
#: anemoi's attention and MLP options of the transformer and graph-transformer blocks (descriptions)
_QK_NORM = ("layer-norm each head's queries and keys over the head dim before the attention (no bias, the weight "
            "shared by the heads: anemoi's qk_norm with its default QueryNorm / KeyNorm); not for gnn")
_MLP_IMPLEMENTATION = ("the blocks' MLP: 'mlp' (Linear, GELU, Linear) or a gated MLP fc2(act(gate) * value), act "
                       "sigmoid ('glu'), SiLU ('swiglu'), GELU ('geglu') or ReLU ('reglu'), gate and value "
                       "num_channels x mlp_ratio wide each (anemoi's mlp_implementation; anemoi recommends mlp_ratio "
                       "~2.67 for gated MLPs); not for gnn")
#: the attention-block fields of a section, with their defaults (not for gnn, whose blocks have neither)
_BLOCK_FIELDS = {"qk_norm": False, "mlp_implementation": "mlp"}


class ProcessorConfig(_Strict):
    """The processor on the hidden nodes.

    ``window_size`` applies to the sliding-window transformer (models ``transformer`` and
    ``ensemble``); ``num_chunks`` to the graph processors. Its split over the model group is
    ``parallel.shard_strategy`` (not a key here).
    """

    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(8, ge=1)
    mlp_ratio: int | float = Field(
        4, gt=0, description="the blocks' MLP width over num_channels (rounded; whole numbers stay integers)")
    window_size: int = Field(64, description="sliding-window half width in hidden nodes, at least 1")
    attention_kernel: AttentionKernel = Field(
        "auto", description="sliding-window kernel: 'auto' (CUDA: flash-attn, else flex attention, else banded; "
        "CPU: banded), 'banded' (every device), 'flex' (torch flex attention: CUDA trains, CPU forward only), "
        "'flash' (flash-attn >= 2.3, CUDA, bf16/fp16)")
    num_chunks: int = Field(1, ge=1)
    self_projection: bool = False  # graphtransformer: anemoi's lin_self in every block
    trainable_edge_size: int = Field(0, ge=0)  # graph processors: trainable features per edge (anemoi's)
    qk_norm: bool = Field(False, description=_QK_NORM)
    mlp_implementation: MLPKind = Field("mlp", description=_MLP_IMPLEMENTATION)
    # gnn only (anemoi's GNNProcessor; defaults: stormshard's interaction network)
    mlp_hidden_layers: int = Field(1, ge=1, description=_MLP_LAYERS)
    edge_embedding: bool = Field(False, description=_EDGE_EMBEDDING + " in the first block (anemoi's proc.0.emb_edges)")
    aggregate_updated_edges: bool = Field(False, description=_AGGREGATE)
    edge_mlp_ratio: float | None = Field(None, gt=0, description=_EDGE_MLP_RATIO)

    @field_validator("window_size")
    @classmethod
    def _check_window(cls, value: int) -> int:
        if value < 1:
            what = "a window of 0 lets every hidden node attend to itself only" if value == 0 else \
                f"a window of {value} is negative"
            raise ValueError(
                f"{what}: the sliding-window transformer needs window_size "
                ">= 1 (a node attends the nodes within window_size of it); give e.g. 64, or the hidden node count "
                "- 1 for full attention"
            )
        return value


#: ``activation_checkpointing``'s values (the model's processor blocks, and each mapper)
Checkpointing = Literal[False, True, "full", "selective"]


def _check_checkpointing(value: object) -> object:
    if value is True or value is False or value in ("full", "selective"):
        return value
    raise ValueError(f"is {value!r}: use false, true (or 'full': recompute the blocks in backward) or 'selective' "
                     "(keep their attention outputs, recompute the rest)")


class MapperConfig(_Strict):
    """An encoder (data -> hidden) or decoder (hidden -> data) graph mapper."""

    num_heads: int = Field(8, ge=1)
    mlp_ratio: float = Field(4.0, gt=0)
    num_chunks: int = Field(1, ge=1)
    self_projection: bool = False  # graph-transformer mapper: anemoi's lin_self
    trainable_edge_size: int = Field(0, ge=0)  # trainable features per edge, appended to the edge attributes
    qk_norm: bool = Field(False, description=_QK_NORM)
    mlp_implementation: MLPKind = Field("mlp", description=_MLP_IMPLEMENTATION)
    # gnn only (anemoi's GNNForwardMapper / GNNBackwardMapper; defaults: stormshard's interaction network)
    mlp_hidden_layers: int = Field(1, ge=1, description=_MLP_LAYERS)
    edge_embedding: bool = Field(False, description=_EDGE_EMBEDDING + " (the mapper's emb_edges)")
    aggregate_updated_edges: bool = Field(False, description=_AGGREGATE)
    edge_mlp_ratio: float | None = Field(None, gt=0, description=_EDGE_MLP_RATIO)
    update_src_nodes: bool = Field(
        False, description="gnn encoder: the data-node latents updated by the encoder's node MLP, x + MLP([x, x]), "
        "before the decoder reads them (anemoi's GNNForwardMapper update_src_nodes; needs edge_embedding)")
    activation_checkpointing: Checkpointing = Field(
        False, description="recompute this mapper in backward (as anemoi checkpoints its mappers): false, true "
        "(= 'full': only its inputs stay) or 'selective' (its graph attention output stays too). The encoder's "
        "keys and values on the data nodes are then not held through the whole step (2.2 GB at the AIFS size)")

    _checkpointing_value = field_validator("activation_checkpointing", mode="before")(
        classmethod(lambda cls, value: _check_checkpointing(value)))


#: the output boundings (anemoi-models' ``layers/bounding.py`` classes, by their stormshard kind)
BoundingKind = Literal["relu", "leaky_relu", "normalized_relu", "normalized_leaky_relu", "hardtanh",
                       "leaky_hardtanh", "fraction", "leaky_fraction"]
_BOUNDS = ("hardtanh", "leaky_hardtanh", "fraction", "leaky_fraction")


class BoundingConfig(_Strict):
    """One bounding of output variables, applied to the normalised prediction after the residual, in the order
    ``model.bounding`` lists them (anemoi's ``ReluBounding``, ``LeakyReluBounding``, ``NormalizedReluBounding``,
    ``NormalizedLeakyReluBounding``, ``HardtanhBounding``, ``LeakyHardtanhBounding``, ``FractionBounding``,
    ``LeakyFractionBounding``; :mod:`stormshard.layers.bounding`).

    ``relu``: ``max(x, 0)``; ``normalized_relu``: ``max(x, t)`` with ``thresholds`` ``t`` (one per variable, in
    normalised units); ``hardtanh``: ``x`` clamped to ``[min_val, max_val]``; ``fraction``: clamped, then times the
    ``total_variable`` (e.g. convective precipitation as a fraction of total precipitation). The ``leaky_`` kinds
    keep a slope of 0.01 outside the bounds."""

    kind: BoundingKind
    variables: tuple[str, ...] = Field(min_length=1)
    min_val: float | None = None
    max_val: float | None = None
    total_variable: str | None = None
    thresholds: tuple[float, ...] | None = None

    @model_validator(mode="after")
    def _check_fields(self) -> BoundingConfig:
        where = f"model.bounding kind={self.kind!r} (variables {list(self.variables)})"
        needs_bounds = self.kind in _BOUNDS
        if needs_bounds and (self.min_val is None or self.max_val is None):
            raise ValueError(f"{where} needs min_val and max_val: give both (e.g. 0 and 1)")
        if needs_bounds and self.min_val > self.max_val:
            raise ValueError(f"{where}: min_val={self.min_val} exceeds max_val={self.max_val}: swap them")
        if not needs_bounds and (self.min_val is not None or self.max_val is not None):
            raise ValueError(f"{where} takes no min_val / max_val (only {list(_BOUNDS)} do): drop them")
        is_fraction = self.kind.endswith("fraction")
        if is_fraction != (self.total_variable is not None):
            raise ValueError(f"{where}: total_variable is {'required' if is_fraction else 'only for fraction kinds'}"
                             f"{': name the output variable the fraction multiplies' if is_fraction else ': drop it'}")
        if is_fraction and self.total_variable in self.variables:
            raise ValueError(f"{where}: total_variable={self.total_variable!r} is one of its own variables (the "
                             "fraction would multiply the total by itself): name another output variable")
        is_normalized = self.kind.startswith("normalized")
        if is_normalized and (self.thresholds is None or len(self.thresholds) != len(self.variables)):
            raise ValueError(f"{where} needs thresholds: one normalised lower bound per variable "
                             f"({len(self.variables)}), got {self.thresholds!r}")
        if not is_normalized and self.thresholds is not None:
            raise ValueError(f"{where} takes no thresholds (only the normalized kinds do): drop them")
        return self


class EnsembleConfig(_Strict):
    """Noise injected into the processor through conditional layer norms (AIFS-CRPS).

    The anemoi options (off by default, an imported anemoi ensemble model sets them; anemoi-models'
    ``AnemoiEnsModelEncProcDec``): ``noise_embedding: "anemoi"`` (its ``NoiseConditioning`` MLP),
    ``fcstep_input`` and ``condition_on_residual`` (extra data-node inputs).
    """

    noise_channels: int = Field(8, ge=1)
    noise_std: float = Field(1.0, gt=0)
    noise_embedding: Literal["mlp", "anemoi"] = Field(
        "mlp", description="the noise embedding the conditional norms read: 'mlp' (Linear(noise_channels, C), GELU, "
        "Linear(C, C); condition C = num_channels wide) or 'anemoi' (anemoi's NoiseConditioning MLP: "
        "Linear(noise_channels, noise_mlp_hidden), GELU, Linear(noise_mlp_hidden, noise_channels), LayerNorm; "
        "condition noise_channels wide)")
    noise_mlp_hidden: int | None = Field(
        None, ge=1, description="noise_embedding 'anemoi': the MLP's hidden width (anemoi's noise_mlp_hidden_dim)")
    fcstep_input: bool = Field(
        False, description="one more data-node input channel, the forecast step min(1, step) of the rollout "
        "(0 on the first step, 1 after: anemoi's fcstep)")
    condition_on_residual: bool = Field(
        False, description="the residual's prognostic variables (the last input state, truncated with "
        "residual 'truncated') as more data-node inputs, after the fcstep channel (anemoi's condition_on_residual)")

    @model_validator(mode="after")
    def _check_noise_embedding(self) -> EnsembleConfig:
        if self.noise_embedding == "anemoi" and self.noise_mlp_hidden is None:
            raise ValueError("model.ensemble.noise_embedding='anemoi' needs model.ensemble.noise_mlp_hidden (the noise "
                             "MLP's hidden width, anemoi's noise_mlp_hidden_dim): set it, e.g. 32")
        if self.noise_embedding != "anemoi" and self.noise_mlp_hidden is not None:
            raise ValueError(f"model.ensemble.noise_mlp_hidden={self.noise_mlp_hidden} is set but "
                             f"noise_embedding={self.noise_embedding!r}: it sizes the 'anemoi' embedding only; drop it "
                             "or set noise_embedding='anemoi'")
        return self

    @property
    def condition_channels(self) -> int | None:
        """Width of the condition the norms read: ``noise_channels`` ('anemoi'), None: ``num_channels``."""
        return self.noise_channels if self.noise_embedding == "anemoi" else None


class ModelConfig(_Strict):
    """A model: ``name`` picks the builder (see :mod:`stormshard.models.registry`).

    The built-ins are encoder-processor-decoders whose sizes are checked here; a custom builder
    (``"package.module:attribute"`` or a registered name) reads what it needs, ``options`` included,
    and checks it itself.
    """

    name: str = "transformer"
    num_channels: int = Field(128, ge=1)
    multistep_input: int = Field(2, ge=1)
    trainable_size: int = Field(8, ge=0)
    processor: ProcessorConfig = ProcessorConfig()
    encoder: MapperConfig = MapperConfig()
    decoder: MapperConfig = MapperConfig()
    ensemble: EnsembleConfig | None = None
    activation_checkpointing: Checkpointing = Field(
        False, description="recompute each processor block's activations in backward: false, true (= 'full': "
        "only the block inputs stay), or 'selective' (the attention outputs stay too: the recompute runs no "
        "attention forward, for one (tokens, channels) tensor more per layer; stormshard.layers.checkpointing)")
    graph_kernel: GraphKernel = Field(
        "auto", description="graph-transformer attention kernel of the encoder, decoder and graph processor: "
        "'auto' (CUDA: Triton when it imports, else csr; elsewhere csr), 'csr' (sparse CSR products, every "
        "device), 'triton' (the Triton kernel: CUDA, or a CPU under TRITON_INTERPRET=1)")
    lean_activations: bool = Field(
        True, description="graph-transformer blocks on large node sets keep fewer activations for the backward: "
        "norms inside the projections that follow them, the MLP's hidden activation once, its backward by row "
        "chunks (the same numbers; no product recomputed); false: the plain composition everywhere")
    # anemoi's AIFS features (all off by default; an imported anemoi model sets them):
    latent_skip: bool = False  # the processor's input added to its output
    decoder_embedding: bool = False  # the decoder's own embedding of the data-node inputs (anemoi's emb_nodes_dst)
    relu_bounded: tuple[str, ...] = ()  # output variables passed through a ReLU (normalised; anemoi's ReluBounding)
    bounding: tuple[BoundingConfig, ...] = Field(
        (), description="output boundings after relu_bounded, in order (anemoi's bounding list: relu, "
        "hardtanh, fraction, their leaky and normalized kinds; stormshard.layers.bounding)")
    node_embedding: Literal["linear", "mlp"] = Field(
        "linear", description="gnn: the data and hidden node embeddings (embed_data, embed_hidden, embed_data_decoder): "
        "one Linear, or an MLP of the encoder's mlp_hidden_layers and mlp_ratio ending in a LayerNorm (anemoi's GNN "
        "mappers' emb_nodes_src / emb_nodes_dst)")
    head: Literal["norm_linear", "mlp"] = Field(
        "norm_linear", description="gnn: the output head on the decoded data nodes: LayerNorm then Linear, or an MLP "
        "of the decoder's mlp_hidden_layers and mlp_ratio without a norm (anemoi's GNN node_data_extractor)")
    residual: Literal["last_step", "truncated"] = Field(
        "last_step", description="what the prognostic outputs add to the network's increment: 'last_step' (the last "
        "input state) or 'truncated' (the last input state through the graph's coarser truncation grid and back, "
        "anemoi's TruncatedConnection: needs graph.truncation, or a graph file with the truncation edges)")
    options: dict[str, Any] = Field(default_factory=dict)

    _checkpointing_value = field_validator("activation_checkpointing", mode="before")(
        classmethod(lambda cls, value: _check_checkpointing(value)))

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if not name.strip():
            raise ValueError(f"model.name={name!r} is empty: name a built-in model {list(BUILTIN_MODELS)}, one added "
                             "with register_model, or your own builder as 'package.module:function'")
        builder_module(name)  # the form only: the registry resolves the name when the model is built
        return name

    @field_validator("options")
    @classmethod
    def _check_options(cls, options: dict[str, Any]) -> dict[str, Any]:
        try:
            json.dumps(options, allow_nan=False)
        except (TypeError, ValueError) as err:
            raise ValueError(
                f"model.options must be JSON-serialisable (it is stored with every checkpoint): {err}; use "
                "strings, numbers, booleans, null, lists and objects"
            ) from None
        return options

    @model_validator(mode="after")
    def _check_sizes(self) -> ModelConfig:
        if not self.is_builtin:  # a custom builder checks its own sizes
            return self
        if self.options:
            raise ValueError(
                f"model.options={self.options!r} is given but model.name={self.name!r} is a built-in model, which "
                "reads its settings from processor / encoder / decoder: drop model.options (it is for custom builders)"
            )
        c = self.num_channels
        for field, heads in (("processor.num_heads", self.processor.num_heads),
                             ("encoder.num_heads", self.encoder.num_heads),
                             ("decoder.num_heads", self.decoder.num_heads)):
            if self.name == "gnn" and field != "processor.num_heads" or heads == 0:
                continue
            if c % heads:
                raise ValueError(
                    f"num_channels={c} is not divisible by {field}={heads}: choose heads dividing the channels"
                )
        self._check_gnn_options()
        self._check_block_options()
        if self.name == "ensemble" and self.ensemble is None:
            object.__setattr__(self, "ensemble", EnsembleConfig())
        if self.name != "ensemble" and self.ensemble is not None:
            raise ValueError(f"model.ensemble is set but model.name={self.name!r}: use name='ensemble' or drop it")
        return self

    def _check_block_options(self) -> None:
        """``qk_norm`` and ``mlp_implementation`` (anemoi's transformer and graph-transformer blocks): not on ``gnn``."""
        if self.name != "gnn":
            return
        for section in ("processor", "encoder", "decoder"):
            for field, default in _BLOCK_FIELDS.items():
                value = getattr(getattr(self, section), field)
                if value != default:
                    raise ValueError(
                        f"model.{section}.{field}={value!r} is set but model.name='gnn': it applies to the attention "
                        "blocks of 'transformer', 'graphtransformer' and 'ensemble' (stormshard's GNN blocks have no "
                        "attention and ungated MLPs): drop it")

    def _check_gnn_options(self) -> None:
        """The GNN options (anemoi's GNN model) only on ``gnn``, and only in combinations that build."""
        fix = "drop it (it applies to model.name='gnn' only) or use model.name='gnn'"
        if self.name != "gnn":
            for field, default in (("node_embedding", "linear"), ("head", "norm_linear")):
                if getattr(self, field) != default:
                    raise ValueError(f"model.{field}={getattr(self, field)!r} is set but model.name={self.name!r}: {fix}")
            for section in ("processor", "encoder", "decoder"):
                for field, default in (_GNN_FIELDS | ({} if section == "processor" else {"update_src_nodes": False})).items():
                    value = getattr(getattr(self, section), field)
                    if value != default:
                        raise ValueError(f"model.{section}.{field}={value!r} is set but model.name={self.name!r}: {fix}")
            return
        if self.decoder.update_src_nodes:
            raise ValueError("model.decoder.update_src_nodes=True: the decoder's sources are the hidden nodes, which "
                             "nothing reads after it; set model.encoder.update_src_nodes (anemoi's forward mapper) instead")
        if self.encoder.update_src_nodes and not self.encoder.edge_embedding:
            raise ValueError("model.encoder.update_src_nodes=True needs model.encoder.edge_embedding=True: the update "
                             "runs the encoder's node MLP on [x, x], which reads num_channels edge features: set "
                             "edge_embedding (as anemoi's GNN mappers have it) or drop update_src_nodes")
        if self.encoder.update_src_nodes and self.decoder_embedding:
            raise ValueError("model.encoder.update_src_nodes=True with model.decoder_embedding=True: the decoder would "
                             "embed the raw inputs and never read the updated data latents: drop one of them (anemoi's "
                             "GNN model has update_src_nodes and no decoder embedding)")

    @property
    def is_builtin(self) -> bool:
        """True for the built-in encoder-processor-decoders (:data:`BUILTIN_MODELS`)."""
        return self.name in BUILTIN_MODELS

    @property
    def uses_graph_processor(self) -> bool:
        """True when the processor is a graph (``graphtransformer``, ``gnn``): sharded by destination node."""
        return self.name in ("graphtransformer", "gnn")
