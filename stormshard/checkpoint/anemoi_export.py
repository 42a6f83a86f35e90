"""Export a bundle imported from anemoi (and possibly fine-tuned since) back to an anemoi inference checkpoint.

``export_anemoi(bundle, out)`` takes the anemoi checkpoint the bundle was imported from (kept in the
bundle as ``anemoi_source.ckpt``), writes the bundle's weights into its tensors (the inverse of
:func:`stormshard.checkpoint.anemoi_import.anemoi_weights`) and writes the zip again with every
other entry (the pickled model, ``anemoi-metadata/anemoi.json``, the supporting arrays) unchanged,
so anemoi-inference loads it as it loaded the original: ``torch.load(out, weights_only=False)``
gives a model whose ``predict_step`` equals the bundle's ``predict``. Nothing is unpickled with
code: the template is read by :mod:`stormshard.checkpoint.anemoi_pickle` and its pickle copied
byte for byte. No anemoi is needed to export.

A bundle exported from a run fine-tuned from an imported bundle (or an anemoi checkpoint:
``training.init_weights``) uses that model's anemoi checkpoint as its template. A bundle with no
anemoi ancestor has no anemoi equivalent here: a :class:`ConversionError`.
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import torch

from stormshard.checkpoint.anemoi_import import TEMPLATE, anemoi_weights
from stormshard.checkpoint.anemoi_layouts import canonical_tensors
from stormshard.checkpoint.anemoi_pickle import module_tensors, open_anemoi_checkpoint
from stormshard.checkpoint.errors import ConversionError
from stormshard.checkpoint.stored_config import stored_model_config
from stormshard.models.variables import VariableIndex

__all__ = ["export_anemoi"]


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


def export_anemoi(bundle: str | os.PathLike, out: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write ``out`` (an anemoi inference checkpoint) from a bundle made by ``import-anemoi``."""
    from safetensors.torch import load_file

    b, target = Path(bundle), Path(out)
    try:
        meta = json.loads((b / "metadata.json").read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConversionError(f"{b} is not a stormshard inference bundle: {exc}",
                              fix="export a bundle first (convert_checkpoint.py export / import-anemoi)") from None
    blocked = (meta.get("anemoi") or {}).get("not_exportable")
    if blocked:
        raise ConversionError(f"{b} cannot be exported to anemoi: {blocked}",
                              fix="import an anemoi-models 0.19 inference checkpoint of the model instead")
    template = _template(b, meta)
    if template is None:
        raise ConversionError(f"{b} has no anemoi equivalent: only bundles made by `import-anemoi` (which keep the "
                              f"anemoi checkpoint they came from, {TEMPLATE}) export to anemoi",
                              fix="import the model from an anemoi checkpoint, fine-tune it, then export it")
    if target.exists() and not overwrite:
        raise ConversionError(f"--out {target} exists", fix="choose another --out or pass --overwrite")
    config = stored_model_config(meta["model"])
    roles = meta["variables"]
    variables = VariableIndex.build(roles["dataset"], roles["forcing"], roles["diagnostic"])
    weights = load_file(str(b / "model.safetensors"))
    ckpt = open_anemoi_checkpoint(template)
    canonical = canonical_tensors(ckpt)
    if ckpt.kind != "inference" or canonical.migrations:
        raise ConversionError(f"{b} descends from {template}, which is not an anemoi-models 0.19 inference checkpoint "
                              f"({ckpt.kind}; {'; '.join(canonical.migrations) or 'no older-layout renames'}): "
                              "export writes into the pickled model of such a file",
                              fix="import the inference-*.ckpt of the model (anemoi-models 0.19) and fine-tune from it")
    tensors = module_tensors(ckpt.root)
    names = canonical.file_names  # the file's own dataset / mapper names where they are not data / 0
    theirs = {names.get(n, n): w for n, w in anemoi_weights(weights, config, len(variables.input_names)).items()}
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
    with zipfile.ZipFile(template) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            key = info.filename.rsplit("/", 1)[-1]
            is_storage = info.filename == f"{ckpt.prefix}/data/{key}"
            data = bytes(ckpt.buffers[key]) if is_storage and key in changed else src.read(info)
            dst.writestr(info, data)
    os.replace(tmp, target)
    return target
