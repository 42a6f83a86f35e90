"""Every anemoi checkpoint layout the import takes, as the tensor names of an anemoi-models 0.19
inference checkpoint (the names :mod:`stormshard.checkpoint.anemoi_import` maps from).

:func:`canonical_tensors` reads the tensors of an opened checkpoint
(:func:`stormshard.checkpoint.anemoi_pickle.open_anemoi_checkpoint`):

- an inference checkpoint: the pickled model's parameters and buffers (``module_tensors``);
- a Lightning ``last.ckpt`` (anemoi-training 0.17): its ``state_dict`` less the ``model.`` prefix
  (``model.model.X`` -> ``model.X``, ``model.pre_processors.X`` -> ``pre_processors.X``). The graph
  providers' edges and edge attributes are non-persistent buffers, absent from a state dict: they
  are taken from the graph the file holds (``hyper_parameters["graph_data"]``, a torch-geometric
  ``HeteroData`` read as inert stubs), sorted by destination (stable) as anemoi's
  ``StaticGraphProvider`` sorts them, attributes concatenated in the config's
  ``sub_graph_edge_attributes`` order (a sliding-window ``TransformerProcessor`` has no processor
  edges: its graph's hidden -> hidden store is empty or absent, as in the inference file);

then renames older layouts the way anemoi-models' migration scripts do (each rule is listed in
``CanonicalTensors.migrations`` when it applied):

- 0.11.0 ``chunking_fix``: ``processor.proc.C.blocks.M`` -> ``processor.proc.N`` (``N = C * blocks
  per chunk + M``; blocks per chunk counted from the keys);
- 0.11.3 ``refactor_mapper``: trainable edge tensors (and, in pickled models, the edge buffers)
  inside the mappers -> their graph providers; ``edge_inc`` dropped;
- 0.12.0 ``move_to_multiple_datasets``: per-dataset pre/post-processors, encoder / decoder and
  graph-provider levels inserted (the single dataset and mapper are the model's only ones);
- 0.13.0 ``fuse_multiple_perdataset_graphs``: per-dataset node attributes fused;
- 0.16.0 ``glu_mlp_implementation``: ``node_dst_mlp.N`` / ``node_src_mlp.N`` -> ``...mlp.mlp.N``;
- 0.16.0 ``trainable_edge_perm_fix``: trainable edge tensors of ``trainable_layout_version`` 0
  (graph order) permuted to destination order; pickled edges not sorted by destination are sorted
  with their trainable tensors.

The dataset's name, the hidden nodes' name and the encoder / decoder keys (user-defined in anemoi)
become ``data``, ``hidden`` and ``0``; ``file_names`` maps the canonical names back to the file's.
Anything of an older layout that no migration rule maps (several datasets, ...) is reported by the
caller naming it. An AIFS 1.x model's truncation matrices (``A_down`` / ``A_up``, attributes of the
pickled model, not tensors of its state) are read by :mod:`stormshard.checkpoint.anemoi_truncation`;
:class:`AnemoiArchitecture` ``.residual`` names them (``hardware.files.truncation`` in the config).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from stormshard.checkpoint.anemoi_bounding import AnemoiBounding, config_bounding
from stormshard.checkpoint.anemoi_pickle import AnemoiCheckpoint, module_tensors
from stormshard.checkpoint.errors import ConversionError

__all__ = ["CanonicalTensors", "canonical_tensors", "PROVIDERS", "dataset_and_hidden_names", "model_config_json",
           "AnemoiArchitecture", "architecture_from_config", "EDGELESS_PROCESSORS", "stored_graph"]

#: graph provider (canonical name prefix) -> (source node set, destination node set), canonical names
PROVIDERS = {"model.encoder_graph_provider.data": ("data", "hidden"),
             "model.processor_graph_provider": ("hidden", "hidden"),
             "model.decoder_graph_provider.data": ("hidden", "data")}
_MAPPER_FOR = {"model.encoder_graph_provider.data": "encoder", "model.processor_graph_provider": "processor",
               "model.decoder_graph_provider.data": "decoder"}
_LAYOUT_KEY = "trainable_layout_version"
#: processors that use no hidden -> hidden edges (anemoi's graph may hold an empty edge store for them)
EDGELESS_PROCESSORS = ("TransformerProcessor",)
_FIX = "re-save the checkpoint with anemoi-models 0.19 (anemoi-models' migration tool), then import that"


@dataclass(frozen=True)
class CanonicalTensors:
    """A checkpoint's tensors under anemoi-models 0.19 inference names. ``file_names``: canonical
    name -> the file's name where they differ; ``migrations``: the older-layout rules applied."""

    tensors: dict[str, Tensor]
    file_names: dict[str, str]
    migrations: tuple[str, ...]


def model_config_json(metadata: dict[str, Any]) -> dict[str, Any]:
    """``metadata["config"]["model"]`` (``{}`` when absent)."""
    config = metadata.get("config") if isinstance(metadata, dict) else None
    model = config.get("model") if isinstance(config, dict) else None
    return model if isinstance(model, dict) else {}


def dataset_and_hidden_names(metadata: dict[str, Any]) -> tuple[str, str]:
    """The single dataset's name (``data`` in metadata 1.0) and the hidden node set's name."""
    dataset = "data"
    indices = metadata.get("data_indices") if isinstance(metadata, dict) else None
    if isinstance(indices, dict) and len(indices) == 1:
        name, sub = next(iter(indices.items()))
        if isinstance(sub, dict) and "data" in sub and "model" in sub:  # metadata 2.0: one level per dataset
            dataset = str(name)
    inner = model_config_json(metadata).get("model")
    hidden = str((inner or {}).get("hidden_nodes_name") or "hidden") if isinstance(inner, dict) else "hidden"
    return dataset, hidden


def _lightning_tensors(ckpt: AnemoiCheckpoint) -> dict[str, Tensor]:
    state = ckpt.root.get("state_dict")
    if not isinstance(state, dict):
        raise ConversionError(f"{ckpt.path}: the Lightning checkpoint's state_dict is a {type(state).__name__}",
                              fix="give the last.ckpt anemoi-training wrote")
    return {k[len("model."):]: v for k, v in state.items() if k.startswith("model.") and isinstance(v, Tensor)}


def _rename(tensors: dict[str, Tensor], names: dict[str, str], fn: Callable[[str], str | None]) -> bool:
    """Apply ``fn`` (new name, or None to drop) to every key; ``names`` tracks canonical -> file name."""
    changed = False
    for key in list(tensors):
        new = fn(key)
        if new == key:
            continue
        changed = True
        t = tensors.pop(key)
        origin = names.pop(key, key)
        if new is not None:
            if new in tensors:
                raise ConversionError(f"renaming {origin} to {new}: the checkpoint has both", fix=_FIX)
            tensors[new], names[new] = t, origin
    return changed


def _chunks(tensors: dict[str, Tensor], names: dict[str, str]) -> bool:
    """0.11.0: ``model.processor.proc.C.blocks.M.rest`` -> ``model.processor.proc.N.rest``."""
    pattern = re.compile(r"^model\.processor\.proc\.(\d+)\.blocks\.(\d+)\.(.+)$")
    found = {(int(m[1]), int(m[2])) for k in tensors if (m := pattern.match(k))}
    if not found:
        return False
    per_chunk = max(j for _, j in found) + 1
    chunks = sorted({c for c, _ in found})
    uneven = [c for c in chunks if {j for cc, j in found if cc == c} != set(range(per_chunk))]
    if uneven or chunks != list(range(len(chunks))):
        raise ConversionError(f"chunked processor keys with uneven chunks (chunks {chunks}, {per_chunk} blocks in the "
                              "largest)", fix=_FIX)

    def flat(key: str) -> str:
        m = pattern.match(key)
        return f"model.processor.proc.{int(m[1]) * per_chunk + int(m[2])}.{m[3]}" if m else key

    return _rename(tensors, names, flat)


def _mapper_edges(tensors: dict[str, Tensor], names: dict[str, str]) -> bool:
    """0.11.3: edge tensors inside the mappers -> the graph providers; ``edge_inc`` dropped."""
    pattern = re.compile(r"^model\.(encoder|processor|decoder)\.(trainable\.trainable|edge_attr|edge_index_base|"
                         r"edge_inc)$")

    def move(key: str) -> str | None:
        m = pattern.match(key)
        if not m:
            return key
        return None if m[2] == "edge_inc" else f"model.{m[1]}_graph_provider.{m[2]}"

    return _rename(tensors, names, move)


def _dataset_levels(tensors: dict[str, Tensor], names: dict[str, str], dataset: str) -> bool:
    """0.12.0 (one dataset): insert the dataset / mapper level; then name them ``data`` and ``0``."""
    changed = False
    for part in ("pre_processors", "post_processors"):
        changed |= _rename(tensors, names, lambda k, p=part: f"{p}.{dataset}.processors." + k[len(p) + 12:]
                           if k.startswith(f"{p}.processors.") else k)
    for provider in ("encoder_graph_provider", "decoder_graph_provider"):
        flat = re.compile(rf"^model\.{provider}\.(trainable\.trainable|edge_attr|edge_index_base|edge_inc|perm|"
                          rf"{_LAYOUT_KEY})$")
        changed |= _rename(tensors, names, lambda k, p=provider, f=flat: f"model.{p}.{dataset}.{k.split('.', 2)[2]}"
                           if f.match(k) else k)
    for mapper in ("encoder", "decoder"):
        flat = re.compile(rf"^model\.{mapper}\.(proc|emb_nodes_src|emb_nodes_dst|node_data_extractor)\.")
        changed |= _rename(tensors, names, lambda k, m=mapper, f=flat: f"model.{m}.0.{k.split('.', 2)[2]}"
                           if f.match(k) else k)
    return changed


def _node_attributes(tensors: dict[str, Tensor], names: dict[str, str], dataset: str) -> bool:
    """0.12.0 -> 0.13.0: ``node_attributes.<dataset>.latlons_<x>`` -> ``node_attributes.latlons_<x>`` (and
    the trainable node tensors alike)."""
    prefix = f"model.node_attributes.{dataset}."

    def fuse(key: str) -> str:
        rest = key[len(prefix):] if key.startswith(prefix) else ""
        return f"model.node_attributes.{rest}" if rest.startswith(("latlons_", "trainable_tensors.")) else key

    return _rename(tensors, names, fuse)


def _canonical_names(tensors: dict[str, Tensor], names: dict[str, str], dataset: str, hidden: str) -> None:
    """The dataset -> ``data``, hidden nodes -> ``hidden``, the single encoder / decoder key -> ``0``."""
    subs = []
    if dataset != "data":
        subs += [(f"model.node_attributes.latlons_{dataset}", "model.node_attributes.latlons_data"),
                 (f"model.node_attributes.trainable_tensors.{dataset}.", "model.node_attributes.trainable_tensors.data."),
                 (f"model.encoder_graph_provider.{dataset}.", "model.encoder_graph_provider.data."),
                 (f"model.decoder_graph_provider.{dataset}.", "model.decoder_graph_provider.data."),
                 (f"pre_processors.{dataset}.", "pre_processors.data."),
                 (f"post_processors.{dataset}.", "post_processors.data.")]
    if hidden != "hidden":
        subs += [(f"model.node_attributes.latlons_{hidden}", "model.node_attributes.latlons_hidden"),
                 (f"model.node_attributes.trainable_tensors.{hidden}.", "model.node_attributes.trainable_tensors.hidden.")]
    for mapper in ("encoder", "decoder"):
        keys = {k.split(".")[2] for k in tensors if k.startswith(f"model.{mapper}.") and k.count(".") >= 3}
        if len(keys) == 1 and keys != {"0"}:
            subs.append((f"model.{mapper}.{next(iter(keys))}.", f"model.{mapper}.0."))
    for old, new in subs:
        _rename(tensors, names, lambda k, o=old, n=new: n + k[len(o):] if k.startswith(o) else k)


def _glu(tensors: dict[str, Tensor], names: dict[str, str]) -> bool:
    """0.16.0: ``node_dst_mlp.N`` / ``node_src_mlp.N`` -> ``node_dst_mlp.mlp.N`` / ``node_src_mlp.mlp.N``."""
    pattern = re.compile(r"\.(node_dst_mlp|node_src_mlp)\.(\d+)\.")
    return _rename(tensors, names, lambda k: pattern.sub(r".\1.mlp.\2.", k))


def _store_mapping(store: Any) -> dict[str, Any]:
    state = getattr(store, "__dict__", {})
    mapping = state.get("_mapping")
    return mapping if isinstance(mapping, dict) else {}


def stored_graph(ckpt: AnemoiCheckpoint) -> Any:
    """The graph the checkpoint holds (a stubbed torch-geometric ``HeteroData``: a Lightning file's
    ``hyper_parameters["graph_data"]``, a pickled model interface's ``graph_data``), or None."""
    if ckpt.kind == "lightning":
        hparams = ckpt.root.get("hyper_parameters") or {}
        graph = hparams.get("graph_data") if isinstance(hparams, dict) else None
    else:
        graph = getattr(ckpt.root, "__dict__", {}).get("graph_data")
    if isinstance(graph, dict) and len(graph) == 1:  # {dataset: HeteroData} (several-graph layouts)
        graph = next(iter(graph.values()))
    return graph if isinstance(getattr(graph, "__dict__", {}).get("_edge_store_dict"), dict) else None


def _graph_edges(ckpt: AnemoiCheckpoint, dataset: str, hidden: str) -> dict[str, dict[str, Tensor]]:
    """The edge sets of ``hyper_parameters["graph_data"]`` (a stubbed HeteroData), canonical node names."""
    graph = stored_graph(ckpt)
    stores = graph.__dict__["_edge_store_dict"] if graph is not None else None
    if not isinstance(stores, dict):
        raise ConversionError(f"{ckpt.path}: the Lightning checkpoint has no graph (hyper_parameters.graph_data "
                              "with edge stores): the edges cannot be taken from the file", fix=_FIX)
    rename = {dataset: "data", hidden: "hidden"}
    out = {}
    for key, store in stores.items():
        if isinstance(key, tuple) and len(key) == 3:
            out[f"{rename.get(key[0], key[0])}->{rename.get(key[2], key[2])}"] = _store_mapping(store)
    return out


def _edge_attributes(model: dict[str, Any], mapper: str) -> list[str]:
    """The edge attributes a graph provider concatenates (0.19 config, else the older ``attributes.edges``)."""
    section: Any = model.get("processor") if mapper == "processor" else None
    if mapper != "processor":
        many = model.get(f"{mapper}s")
        section = next(iter(many.values())).get("mapper") if isinstance(many, dict) and many else model.get(mapper)
    attrs = (section or {}).get("sub_graph_edge_attributes") if isinstance(section, dict) else None
    attrs = attrs or (model.get("attributes") or {}).get("edges") or ["edge_length", "edge_dirs"]
    return [str(a) for a in attrs]


def _sort_by_destination(edge_index: Tensor) -> Tensor:
    """The stable permutation sorting edges by destination (anemoi's ``sort_edge_index_by_dst``)."""
    return torch.sort(edge_index[1], stable=True).indices


def _lightning_edges(ckpt: AnemoiCheckpoint, tensors: dict[str, Tensor], dataset: str, hidden: str,
                     migrations: list[str]) -> None:
    """The graph providers' edge buffers from the file's graph; legacy trainable edges permuted."""
    edges = _graph_edges(ckpt, dataset, hidden)
    model = model_config_json(ckpt.metadata)
    permuted = []
    for provider, (src, dst) in PROVIDERS.items():
        if provider == "model.processor_graph_provider" and _target(model.get("processor")) in EDGELESS_PROCESSORS:
            continue  # a sliding-window transformer attends over the node order: its graph has no processor edges
        store = edges.get(f"{src}->{dst}")
        if store is None or "edge_index" not in store:
            raise ConversionError(f"{ckpt.path}: the graph has no {src} -> {dst} edges", fix=_FIX)
        attrs = _edge_attributes(model, _MAPPER_FOR[provider])
        missing = [a for a in attrs if not isinstance(store.get(a), Tensor)]
        if missing:
            raise ConversionError(f"{ckpt.path}: the graph's {src} -> {dst} edges have no {missing}", fix=_FIX)
        edge_index = store["edge_index"].long()
        perm = _sort_by_destination(edge_index)
        tensors[f"{provider}.edge_index_base"] = edge_index[:, perm].contiguous()
        tensors[f"{provider}.edge_attr"] = torch.cat([store[a].float() for a in attrs], dim=1)[perm].contiguous()
        version = tensors.get(f"{provider}.{_LAYOUT_KEY}")
        trainable = tensors.get(f"{provider}.trainable.trainable")
        if trainable is not None and trainable.shape[0] == perm.shape[0] and (version is None or int(version) < 1):
            tensors[f"{provider}.trainable.trainable"] = trainable.index_select(0, perm)
            permuted.append(provider.split(".")[1])
    if permuted:
        migrations.append(f"0.16.0 trainable_edge_perm_fix: {', '.join(permuted)} trainable edges to destination order")


def _sort_pickled_edges(tensors: dict[str, Tensor], migrations: list[str]) -> None:
    """Pickled models before 0.16 keep edges (and their trainable tensors) in graph order: sort them together."""
    sorted_ = []
    for provider in PROVIDERS:
        edge_index = tensors.get(f"{provider}.edge_index_base")
        if edge_index is None or edge_index.shape[1] < 2 or bool((edge_index[1, 1:] >= edge_index[1, :-1]).all()):
            continue
        perm = _sort_by_destination(edge_index.long())
        for name in ("edge_index_base", "edge_attr", "trainable.trainable"):
            t = tensors.get(f"{provider}.{name}")
            if t is not None:
                tensors[f"{provider}.{name}"] = t[:, perm] if name == "edge_index_base" else t.index_select(0, perm)
        sorted_.append(provider.split(".")[1])
    if sorted_:
        migrations.append(f"0.16.0 trainable_edge_perm_fix: {', '.join(sorted_)} edges sorted by destination")


def canonical_tensors(ckpt: AnemoiCheckpoint) -> CanonicalTensors:
    """The checkpoint's tensors under anemoi-models 0.19 inference names (see the module docstring)."""
    dataset, hidden = dataset_and_hidden_names(ckpt.metadata)
    tensors = _lightning_tensors(ckpt) if ckpt.kind == "lightning" else module_tensors(ckpt.root)
    names: dict[str, str] = {}
    if ckpt.kind == "lightning":
        names = {k: f"model.{k}" for k in tensors}
    migrations = []
    if _chunks(tensors, names):
        migrations.append("0.11.0 chunking_fix: processor.proc.C.blocks.M -> processor.proc.N")
    if _mapper_edges(tensors, names):
        migrations.append("0.11.3 refactor_mapper: trainable edges inside the mappers -> graph providers")
    if _dataset_levels(tensors, names, dataset):
        migrations.append("0.12.0 move_to_multiple_datasets: per-dataset processors, mappers and graph providers")
    if _node_attributes(tensors, names, dataset):
        migrations.append("0.13.0 fuse_multiple_perdataset_graphs: per-dataset node attributes fused")
    if _glu(tensors, names):
        migrations.append("0.16.0 glu_mlp_implementation: node_dst_mlp.N -> node_dst_mlp.mlp.N")
    _canonical_names(tensors, names, dataset, hidden)
    if ckpt.kind == "lightning":
        _lightning_edges(ckpt, tensors, dataset, hidden, migrations)
    else:
        _sort_pickled_edges(tensors, migrations)
    return CanonicalTensors(tensors, {k: v for k, v in names.items() if k != v}, tuple(migrations))


@dataclass(frozen=True)
class AnemoiArchitecture:
    """What the import needs of an anemoi model besides its tensors (class names are short names):
    read from the pickled model (inference checkpoints of the 0.19 layout) or from the training
    config in the metadata (Lightning checkpoints, older pickled layouts)."""

    source: str  # "pickled model" or "metadata config"
    processor: str
    encoders: tuple[str, ...]
    decoders: tuple[str, ...]
    processor_heads: int
    encoder_heads: int
    decoder_heads: int
    window_size: int  # sliding-window transformer processors (0: none)
    attention_options: tuple[str, ...]  # transformer attention options stormshard lacks, in use
    latent_skip: bool
    boundings: tuple[AnemoiBounding, ...]  # the output boundings, in order
    n_step_input: int
    n_step_output: int
    residual: str  # "SkipConnection", or what replaces it (e.g. truncation matrices)


def _target(section: Any) -> str:
    return str((section or {}).get("_target_", "?")).rsplit(".", 1)[-1] if isinstance(section, dict) else "?"


def _mappers(model: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    many = model.get(f"{kind}s")  # 0.12+: encoders / decoders by key, each with its mapper
    if isinstance(many, dict) and many:
        return [dict((v or {}).get("mapper") or {}) for v in many.values()]
    one = model.get(kind)  # older: one encoder / decoder section
    return [one] if isinstance(one, dict) else []


def _truncation(config: dict[str, Any], model: dict[str, Any], dataset: str) -> str:
    """The residual: the ``model.residual`` class, or the truncation matrices of an AIFS 1.x config
    (``hardware.files.truncation``, ``model.truncation_data``). ``system.input.truncation`` (anemoi-training
    0.17+) counts only without a ``model.residual`` class: a 0.19 model uses it only through that section."""
    residual = model.get("residual")
    name = "?"
    if isinstance(residual, dict):
        residual = (residual.get("datasets") or {}).get(dataset, residual) if "datasets" in residual else residual
        name = _target(residual)
        if name not in ("SkipConnection", "?"):
            return name
    for section, key in (("hardware", "files"),) + ((("system", "input"),) if name == "?" else ()):
        files = (config.get(section) or {}).get(key) or {}
        if isinstance(files, dict) and (files.get("truncation") or files.get("truncation_inv")):
            return f"truncation matrices ({section}.{key}.truncation)"
    if model.get("truncation_data"):
        return "truncation matrices (model.truncation_data)"
    return "SkipConnection"


def architecture_from_config(metadata: dict[str, Any]) -> AnemoiArchitecture:
    """The architecture from ``metadata["config"]`` (anemoi-training 0.17 config, or the older one with
    ``model.encoder`` / ``model.decoder`` and ``training.multistep_input``)."""
    dataset, _ = dataset_and_hidden_names(metadata)
    config = metadata.get("config") or {}
    model = model_config_json(metadata)
    proc = model.get("processor")
    if not isinstance(proc, dict) or "_target_" not in proc:
        raise ConversionError("the metadata has no model.processor config: the architecture cannot be read "
                              "(metadata older than anemoi-training's config in the checkpoint)", fix=_FIX)
    encs, decs = _mappers(model, "encoder"), _mappers(model, "decoder")
    bounding = model.get("bounding") or []
    if isinstance(bounding, dict):
        bounding = (bounding.get("datasets") or {}).get(dataset) or []
    task, training = config.get("task") or {}, config.get("training") or {}
    inner = model.get("model") if isinstance(model.get("model"), dict) else {}
    window = proc.get("window_size")
    return AnemoiArchitecture(
        source="metadata config", processor=_target(proc),
        encoders=tuple(_target(m) for m in encs), decoders=tuple(_target(m) for m in decs),
        processor_heads=int(proc.get("num_heads") or 0),
        encoder_heads=int((encs[0] if encs else {}).get("num_heads") or 0),
        decoder_heads=int((decs[0] if decs else {}).get("num_heads") or 0),
        window_size=int(window[0] if isinstance(window, (list, tuple)) else window or 0),
        attention_options=tuple(k for k in ("use_alibi_slopes", "use_rotary_embeddings", "softcap")
                                if _target(proc) == "TransformerProcessor" and proc.get(k)),
        # anemoi-models before the option added the processor's input to its output unconditionally
        latent_skip=bool(inner.get("latent_skip", True)),
        boundings=tuple(config_bounding(b) for b in bounding if isinstance(b, dict)),
        n_step_input=int(task.get("multistep_input") or training.get("multistep_input") or 1),
        n_step_output=int(task.get("multistep_output") or training.get("multistep_output") or 1),
        residual=_truncation(config, model, dataset),
    )
