"""Export a stormshard model to an anemoi inference checkpoint (``convert_checkpoint.py export-anemoi``).

Two ways, chosen by where the model came from:

- **written into its anemoi checkpoint** (a bundle made by ``import-anemoi`` from an anemoi-models
  0.19 inference checkpoint, possibly fine-tuned since, or a bundle of a run fine-tuned from one):
  the checkpoint it descends from (kept as ``anemoi_source.ckpt``) gets the bundle's weights (the
  inverse of :func:`stormshard.checkpoint.anemoi_weights.anemoi_weights`) written into its tensors, and
  every other zip entry (the pickled model, ``anemoi-metadata/anemoi.json``, the supporting arrays) is
  copied unchanged: the bundle's residual must be the pickled one (a truncated residual's matrices its
  graph's truncation edges), else a :class:`ConversionError`. Nothing is unpickled with code (:mod:`stormshard.checkpoint.anemoi_pickle`); no
  anemoi needed.
- **built** (any other bundle or training checkpoint of a ``graphtransformer`` or ``transformer``
  model: trained in stormshard, or imported from a Lightning / older-layout file):
  :mod:`stormshard.checkpoint.anemoi_plan` maps the model onto anemoi's (config, graph, weights,
  normaliser, metadata; a model with no anemoi equivalent is a :class:`ConversionError` naming the
  option, before anything else), then :mod:`stormshard.checkpoint.anemoi_build` builds anemoi's own
  ``AnemoiModelInterface`` from it (needs anemoi-models importable), checks that its ``predict_step``
  equals the bundle's ``predict`` on a random state (1e-4 of each output variable's spread) and saves it
  as anemoi-training's checkpoint callback does.

Either way ``torch.load(out, weights_only=False)`` in an environment with anemoi-models gives a model
whose ``predict_step`` equals the bundle's ``predict``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch

from stormshard.checkpoint.anemoi_bounding import check_same_boundings
from stormshard.checkpoint.anemoi_build import (
    build_anemoi_interface,
    require_anemoi,
    save_anemoi_checkpoint,
    verify_anemoi_model,
)
from stormshard.checkpoint.anemoi_files import check_anemoi_file
from stormshard.checkpoint.anemoi_import import anemoi_architecture, anemoi_latlon
from stormshard.checkpoint.anemoi_layouts import canonical_tensors
from stormshard.checkpoint.anemoi_pickle import module_tensors, open_anemoi_checkpoint
from stormshard.checkpoint.anemoi_plan import (
    ExportSource,
    anemoi_parameters,
    check_exportable,
    plan_anemoi_export,
)
from stormshard.checkpoint.anemoi_truncation import check_same_residual, read_truncation
from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.export import BUNDLE_FORMAT, InferenceModel, export_bundle, load_model
from stormshard.checkpoint.stored_config import checkpoint_model_section, stored_model_config
from stormshard.errors import disk_full_error, is_disk_full
from stormshard.graphs.builder import load_graph
from stormshard.models.variables import VariableIndex
from stormshard.progress import note, phase

__all__ = ["export_anemoi"]

_STATS = ("mean", "stdev", "minimum", "maximum")


def _template(bundle: Path, meta: dict) -> Path | None:
    """The anemoi checkpoint a bundle descends from: its own (``import-anemoi``), or, for a bundle
    exported from a fine-tuning run, that of the run's ``training.init_weights`` (an imported bundle
    or an anemoi checkpoint), followed back through earlier fine-tunes."""
    seen: set[Path] = set()
    while bundle not in seen:
        seen.add(bundle)
        name = (meta.get("anemoi") or {}).get("template")
        if name and (bundle / str(name)).is_file():
            return bundle / str(name)
        if name:  # import-anemoi kept it: without it the bundle cannot be written back into its anemoi file
            raise ConversionError(
                f"{bundle / str(name)} is missing: {bundle / 'metadata.json'} (anemoi.template) names it as the "
                f"anemoi checkpoint this bundle was imported from ({(meta.get('anemoi') or {}).get('uuid') or '?'}), "
                "and export-anemoi writes the weights into it",
                fix=f"copy the original anemoi inference checkpoint to {bundle / str(name)} (or import it again with "
                    "convert_checkpoint.py import-anemoi)")
        source = ((meta.get("experiment") or {}).get("training") or {}).get("init_weights")
        if not source:
            return None
        src = Path(source)
        if src.is_file():
            return src if zipfile.is_zipfile(src) else None
        try:
            meta, bundle = json.loads((src / "metadata.json").read_text()), src
        except (OSError, ValueError):
            return None
    return None


def _bundle_weights(bundle: Path) -> dict[str, torch.Tensor]:
    """The bundle's ``model.safetensors``; a damaged file is a :class:`ConversionError` naming it."""
    from safetensors.torch import load_file

    path = bundle / "model.safetensors"
    try:
        return load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - a header or data error of any kind means a damaged file
        raise ConversionError(f"{path}: cannot be read ({type(exc).__name__}: {str(exc)[:160]})",
                              fix="the bundle is damaged: export it again") from None


def _write_into_template(b: Path, meta: dict, template: Path, target: Path) -> Path:
    """The bundle's weights written into the tensors of the anemoi checkpoint it descends from."""
    config = stored_model_config(meta["model"])
    roles = meta["variables"]
    variables = VariableIndex.build(roles["dataset"], roles["forcing"], roles["diagnostic"])
    weights = _bundle_weights(b)
    check_anemoi_file(template)
    ckpt = open_anemoi_checkpoint(template)
    canonical = canonical_tensors(ckpt)
    if ckpt.kind != "inference" or canonical.migrations:
        raise ConversionError(f"{b} descends from {template}, which is not an anemoi-models 0.19 inference checkpoint "
                              f"({ckpt.kind}; {'; '.join(canonical.migrations) or 'no older-layout renames'}): "
                              "export writes into the pickled model of such a file",
                              fix="import the inference-*.ckpt of the model (anemoi-models 0.19) and fine-tune from it")
    tensors = module_tensors(ckpt.root)
    names = canonical.file_names  # the file's own dataset / mapper names where they are not data / 0
    graph = load_graph(b / "graph.pt")
    latlon = canonical.tensors.get("model.node_attributes.latlons_data")
    arch = anemoi_architecture(ckpt)  # the template's pickled residual and boundings are copied unchanged
    if latlon is not None:  # so they must be the bundle's
        truncation = read_truncation(ckpt, arch, anemoi_latlon(latlon))
        check_same_residual(truncation, config.residual, graph, f"{b} (written into {template})")
    check_same_boundings(arch.boundings, canonical.tensors, config.relu_bounded, config.bounding,
                         f"{b} (written into {template})")
    mapped, _ = anemoi_parameters(weights, config, len(variables.input_names), graph, b)
    theirs = {names.get(n, n): w for n, w in mapped.items()}
    problems = [f"{n}: not in the anemoi model" for n in theirs if n not in tensors]
    problems += [f"{n}: stormshard {tuple(w.shape)} vs anemoi {tuple(tensors[n].shape)}" for n, w in theirs.items()
                 if n in tensors and tuple(w.shape) != tuple(tensors[n].shape)]
    if problems:
        raise ConversionError(f"{b}: the weights do not fit the anemoi model they were imported from:", problems)
    changed: set[str] = set()
    with torch.no_grad():
        for name, w in theirs.items():
            tensors[name].copy_(w.to(tensors[name].dtype))  # writes into the storage bytes of the template
            changed.add(ckpt.storage_key(tensors[name]))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".partial")
    try:
        with zipfile.ZipFile(template) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as dst:
            for info in src.infolist():
                key = info.filename.rsplit("/", 1)[-1]
                is_storage = info.filename == f"{ckpt.prefix}/data/{key}"
                data = bytes(ckpt.buffers[key]) if is_storage and key in changed else src.read(info)
                dst.writestr(info, data)
        os.replace(tmp, target)
    except BaseException as exc:  # a full disk, an interrupt: no half-written file stays behind
        tmp.unlink(missing_ok=True)
        if is_disk_full(exc):
            raise disk_full_error(exc, target) from exc
        raise
    return target


def _bundle_metadata(path: Path) -> dict | None:
    """A bundle's metadata.json, or None when ``path`` is not a bundle (a training checkpoint, maybe)."""
    try:
        meta = json.loads((path / "metadata.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return meta if isinstance(meta, dict) and meta.get("format") == BUNDLE_FORMAT else None


def export_anemoi(source: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False,
                  dataset: str | os.PathLike | None = None, graph: str | os.PathLike | None = None) -> Path:
    """Write ``out`` (an anemoi inference checkpoint) from a bundle or a training checkpoint (``dataset``
    / ``graph``: where a checkpoint's training data and graph now are, if moved); see the module docstring."""
    src, target = Path(source), Path(out)
    if not src.exists():
        raise ConversionError(f"{src} is not a stormshard inference bundle or training checkpoint: it does not exist",
                              fix="pass a bundle (convert_checkpoint.py export / import-anemoi) or a run's checkpoints")
    if target.exists() and not overwrite:
        raise ConversionError(f"--out {target} exists", fix="choose another --out or pass --overwrite")
    meta = _bundle_metadata(src)
    blocked = (meta.get("anemoi") or {}).get("not_exportable") if meta else None
    template = _template(src, meta) if meta and not blocked else None
    if template is not None and target.resolve() == template.resolve():  # even with --overwrite
        raise ConversionError(f"--out {target} is the anemoi checkpoint {src} descends from, which export-anemoi "
                              "reads and writes the weights into: export never replaces its source",
                              fix="choose another --out")
    if template is not None:
        return _write_into_template(src, meta, template, target)
    why = (f"{src} cannot be exported to anemoi by writing into its anemoi checkpoint ({blocked})" if blocked else
           f"{src} has no anemoi checkpoint to write into (not imported from an anemoi inference checkpoint)")
    with contextlib.ExitStack() as stack:
        bundle = src
        if meta is None:  # a training checkpoint: its bundle first (config, graph, statistics)
            check_exportable(stored_model_config(checkpoint_model_section(src)[0] or {}), src)  # before its builder
            bundle = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="export-anemoi-"))) / "bundle"
            with phase(f"export-anemoi: read {src}"):
                export_bundle(src, bundle, dataset=dataset, graph=graph)
            meta = json.loads((bundle / "metadata.json").read_text())
        check_exportable(stored_model_config(meta["model"]), src)  # before anything is loaded or anemoi needed
        reference = load_model(bundle)
        plan = plan_anemoi_export(_export_source(src, bundle, meta, reference))
        require_anemoi(why)
        with phase("export-anemoi: build anemoi's model"):
            model, metadata = build_anemoi_interface(plan, src)
        with phase("export-anemoi: compare anemoi's predict_step with stormshard's predict"):
            error = verify_anemoi_model(model, reference.predict, plan, src)
        note(f"export-anemoi: predict_step equals predict to {error:.2g} of the output spread")
        for line in plan.notes:
            note(f"export-anemoi: {line}")
        return save_anemoi_checkpoint(model, metadata, plan, target)


def _export_source(src: Path, bundle: Path, meta: dict, reference: InferenceModel) -> ExportSource:
    """What the plan needs from a bundle (``reference``: the bundle loaded, for its graph, variables, config); the
    loss of the run that trained it (its ``experiment.training``, or for an imported bundle the anemoi loss the
    import read)."""
    stats = json.loads((bundle / "statistics.json").read_text())
    variables = reference.variables
    timestep = meta.get("timestep") or _dataset_frequency(meta, src)
    return ExportSource(
        path=src, config=reference.config, graph=reference.graph, variables=variables,
        weights=_bundle_weights(bundle),
        statistics={k: np.array([stats[n][k] for n in variables.variables], dtype=np.float64) for k in _STATS},
        normalisation=meta.get("normalisation") or {"default": "mean-std", "methods": {}}, timestep=str(timestep),
        step=int(meta.get("step", 0)), dataset=meta.get("dataset") or {},
        training=(meta.get("experiment") or {}).get("training") or (meta.get("anemoi") or {}).get("training_loss") or {})


def _dataset_frequency(meta: dict, src: Path) -> str:
    """The timestep of a model trained with ``data.timestep: null``: its dataset's frequency."""
    from stormshard.data.anemoi_layout import AnemoiDataset
    from stormshard.data.dates import frequency_to_string

    path = (meta.get("dataset") or {}).get("path")
    try:
        return frequency_to_string(AnemoiDataset.open(path).frequency)
    except Exception as err:  # noqa: BLE001 - any unreadable dataset gives the same advice
        raise ConversionError(f"{src}: timestep=None (data.timestep was null: the dataset's frequency) and the dataset "
                              f"{path!r} cannot be read for it ({type(err).__name__}: {str(err)[:120]})",
                              fix="export the bundle where its dataset is readable, or set data.timestep") from None
