"""Older anemoi checkpoint layouts: ``import-anemoi`` maps what anemoi-models' migration scripts map
(``anemoi/models/migrations/scripts``) and names what it cannot (exit 2, one ``error:`` line).

The old-layout files are derived from the real Lightning fixture (``fixtures/anemoi/gt/last.ckpt``,
anemoi-training 0.17.1 / anemoi-models 0.19.0) by :func:`write_old_layout`: it renames the state dict's
keys inside the pickle (string opcodes rewritten, nothing unpickled with code), puts the trainable
edge tensors back in graph order where the layout predates the destination sort, and rewrites the
metadata the way that version wrote it. No anemoi needed.
"""

from __future__ import annotations

import json
import pickletools
import re
import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

import stormshard
from launch.convert_checkpoint import main as convert_main
from stormshard.checkpoint.anemoi_import import read_anemoi
from stormshard.checkpoint.anemoi_pickle import open_anemoi_checkpoint
from stormshard.checkpoint.errors import ConversionError
from tests.anemoi_repickle import rewrite_metadata

FIXTURES = Path(__file__).parent / "fixtures" / "anemoi"
LAST = FIXTURES / "gt" / "last.ckpt"
_PROVIDERS = {"encoder": "model.model.encoder_graph_provider.data", "processor": "model.model.processor_graph_provider",
              "decoder": "model.model.decoder_graph_provider.data"}
_EDGES = {"encoder": ("data", "to", "hidden"), "processor": ("hidden", "to", "hidden"),
          "decoder": ("hidden", "to", "data")}


def _rename_pickle_strings(data: bytes, rename: Callable[[str], str]) -> bytes:
    """The pickle with every unicode string ``s`` replaced by ``rename(s)`` (protocol 2: no frames, so
    every other opcode is copied byte for byte; memo references are by index, not offset)."""
    ops = list(pickletools.genops(data))
    out = bytearray()
    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        if op.name == "BINUNICODE" and isinstance(arg, str) and rename(arg) != arg:
            raw = rename(arg).encode("utf-8")
            out += b"X" + struct.pack("<I", len(raw)) + raw
        else:
            out += data[pos:end]
    return bytes(out)


def _old_key(key: str, version: str) -> str:
    """A state-dict key of the 0.19 layout as anemoi-models ``version`` named it (the inverse of the
    migration scripts up to 0.19)."""
    key = re.sub(r"\.(node_dst_mlp|node_src_mlp)\.mlp\.(\d+)\.", r".\1.\2.", key)  # before 0.16 (glu_mlp)
    for block, provider in _PROVIDERS.items():  # before 0.16 no layout version; edge_inc before 0.11.3
        if key == f"{provider}.trainable_layout_version":
            return f"model.model.{block}.edge_inc" if version == "0.10" else key.replace(
                "trainable_layout_version", "edge_inc")
    if version == "0.12":  # between move_to_multiple_datasets and fuse_multiple_perdataset_graphs
        key = re.sub(r"^model\.model\.(encoder|decoder)\.0\.", r"model.model.\1.data.", key)
        key = re.sub(r"^model\.model\.node_attributes\.(latlons_|trainable_tensors\.)",
                     r"model.model.node_attributes.data.\1", key)
        return key
    # 0.10: one unnamed encoder / decoder, edges inside the mappers, per-model processors, chunked processor
    key = re.sub(r"^model\.model\.(encoder|decoder)\.0\.", r"model.model.\1.", key)
    for block, provider in _PROVIDERS.items():
        key = key.replace(f"{provider}.trainable.trainable", f"model.model.{block}.trainable.trainable")
    key = re.sub(r"^model\.(pre|post)_processors\.data\.", r"model.\1_processors.", key)
    return re.sub(r"^model\.model\.processor\.proc\.(\d+)\.", r"model.model.processor.proc.0.blocks.\1.", key)


def _old_metadata(meta: dict, version: str) -> dict:
    """Metadata as that version wrote it: 1.0 (single-dataset ``data_indices``, config with
    ``model.encoder`` / ``model.decoder``, ``training.multistep_input``) for 0.10."""
    meta = json.loads(json.dumps(meta))
    if version != "0.10":
        return meta
    meta["version"] = "1.0"
    meta["data_indices"] = meta["data_indices"]["data"]
    meta.pop("supporting_arrays_paths", None)
    config, model = meta["config"], meta["config"]["model"]
    model["encoder"] = model.pop("encoders")["0"]["mapper"]
    model["decoder"] = model.pop("decoders")["0"]["mapper"]
    model["bounding"] = model["bounding"]["datasets"]["data"]
    model.pop("residual")
    model["model"].pop("latent_skip")  # always on before the option
    task = config.pop("task")
    config.setdefault("training", {})["multistep_input"] = task["multistep_input"]
    config.setdefault("data", {})["timestep"] = task["timestep"]
    return meta


def write_old_layout(path: Path, version: str, edit_metadata: Callable[[dict], None] | None = None) -> Path:
    """``LAST`` in the layout of anemoi-models ``version``: "0.10" (AIFS 1.x era: metadata 1.0 in
    ``ai-models.json``, chunked processor ``proc.C.blocks.M``, trainable edge tensors inside the mappers,
    ``node_dst_mlp.N``, unprefixed pre/post-processors, trainable edges in graph order) or "0.12"
    (per-dataset node attributes, encoder / decoder keyed by dataset, ``node_dst_mlp.N``, trainable
    edges in graph order)."""
    ckpt = open_anemoi_checkpoint(LAST)
    state, graph = ckpt.root["state_dict"], ckpt.root["hyper_parameters"]["graph_data"]
    changed = set()
    with torch.no_grad():  # trainable edges back to graph order: old[perm] = sorted (perm: stable sort by dst)
        for block, provider in _PROVIDERS.items():
            edge_index = graph.__dict__["_edge_store_dict"][_EDGES[block]].__dict__["_mapping"]["edge_index"]
            perm = torch.sort(edge_index[1].long(), stable=True).indices
            t = state[f"{provider}.trainable.trainable"]
            old = torch.empty_like(t)
            old[perm] = t
            t.copy_(old)
            changed.add(ckpt.storage_key(t))
    names = set(state)
    with zipfile.ZipFile(LAST) as src, zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            key = info.filename.rsplit("/", 1)[-1]
            data = src.read(info)
            if info.filename == f"{ckpt.prefix}/data.pkl":
                data = _rename_pickle_strings(data, lambda s: _old_key(s, version) if s in names else s)
            elif info.filename == f"{ckpt.prefix}/data/{key}" and key in changed:
                data = bytes(ckpt.buffers[key])
            elif info.filename.endswith("anemoi-metadata/anemoi.json"):
                meta = _old_metadata(json.loads(data), version)
                if edit_metadata:
                    edit_metadata(meta)
                data = json.dumps(meta).encode()
                if version == "0.10":
                    dst.writestr(f"{ckpt.prefix}/ai-models.json", data)
                    continue
            elif "anemoi-metadata/" in info.filename and version == "0.10":
                continue  # no supporting arrays before metadata 2.0
            dst.writestr(info, data)
    return path


@pytest.mark.parametrize("version", ["0.10", "0.12"])
def test_old_layout_imports_and_predicts(version, tmp_path, capsys):
    """An old-layout ``last.ckpt`` imports to the weights of today's layout (migration rules applied,
    listed in the bundle) and predicts what anemoi's ``predict_step`` predicts."""
    from safetensors.torch import load_file

    old = write_old_layout(tmp_path / f"aifs-{version}.ckpt", version)
    with zipfile.ZipFile(old) as z:
        keys = [k for k in open_anemoi_checkpoint(old).root["state_dict"]]
        assert not any(".node_dst_mlp.mlp." in k for k in keys)
        assert ("model.model.processor.proc.0.blocks.1.lin_key.weight" in keys) == (version == "0.10")
        assert any(n.endswith("ai-models.json") for n in z.namelist()) == (version == "0.10")
    out, ref = tmp_path / "bundle", tmp_path / "ref"
    assert convert_main(["import-anemoi", str(old), "--out", str(out)]) == 0
    assert convert_main(["import-anemoi", str(LAST), "--out", str(ref)]) == 0
    a, b = load_file(str(out / "model.safetensors")), load_file(str(ref / "model.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[n], b[n]) for n in a)  # trainable edges permuted back too
    meta = json.loads((out / "metadata.json").read_text())
    migrations = " ".join(meta["anemoi"]["migrations"])
    expected = ["0.16.0 glu_mlp", "0.16.0 trainable_edge_perm_fix"]
    expected += ["0.11.0 chunking_fix", "0.11.3 refactor_mapper", "0.12.0 move_to_multiple_datasets"] \
        if version == "0.10" else ["0.13.0 fuse_multiple_perdataset_graphs"]
    assert all(m in migrations for m in expected), migrations
    assert meta["timestep"] == "6h" and meta["model"] == json.loads((ref / "metadata.json").read_text())["model"]
    x = torch.from_numpy(np.load(FIXTURES / "gt" / "input.npy"))
    expected_y = np.load(FIXTURES / "gt" / "output.npy")
    got = stormshard.load_model(out).predict(x).numpy()
    spread = expected_y.reshape(-1, expected_y.shape[-1]).std(axis=0)
    err = np.abs(got - expected_y).reshape(-1, expected_y.shape[-1]).max(axis=0) / spread
    assert (err <= 1e-4).all(), err
    capsys.readouterr()
    assert convert_main(["export-anemoi", str(out), "--out", str(tmp_path / "x.ckpt")]) == 2
    assert "cannot be exported to anemoi" in capsys.readouterr().err


def _truncated_residual(meta: dict) -> None:
    meta["config"]["model"]["residual"]["datasets"]["data"]["_target_"] = \
        "anemoi.models.layers.residual.TruncatedConnection"


def _aifs1_truncation(meta: dict) -> None:
    meta["config"].setdefault("hardware", {}).setdefault("files", {})["truncation"] = "O96-to-O48.npz"


@pytest.mark.parametrize(("version", "edit", "what"), [
    ("0.19", _truncated_residual, "residual (TruncatedConnection) keeps its truncation matrices outside"),
    ("0.10", _aifs1_truncation, "residual (truncation matrices (hardware.files.truncation)) keeps"),
])
def test_truncation_matrices_absent_from_a_lightning_checkpoint_are_a_clear_error(version, edit, what, tmp_path,
                                                                                    capsys):
    """A Lightning checkpoint of a truncated residual (anemoi-models 0.13+ ``TruncatedConnection``, AIFS 1.x
    ``hardware.files.truncation``) holds no truncation matrices (attributes of the model, not in its state
    dict): exit 2, one error line naming the file and the fix (its inference checkpoint), nothing written.
    (Those whose pickled model holds them import: ``tests/test_anemoi_truncation.py``.)"""
    src = tmp_path / "trunc.ckpt"
    if version == "0.19":
        rewrite_metadata(LAST, src, edit)
    else:
        write_old_layout(src, version, edit)
    assert convert_main(["import-anemoi", str(src), "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {src}: a Lightning checkpoint") and \
        "holds no truncation matrices" in errors[0], errors
    assert "import the inference-*.ckpt" in err
    assert not (tmp_path / "b").exists()
    with pytest.raises(ConversionError, match=re.escape(what)):
        read_anemoi(src)


def test_uneven_chunks_are_a_clear_error(tmp_path, capsys):
    """Chunked processor keys that no block count explains (chunk 0 with blocks 0-1, chunk 1 with
    block 0) are not guessed at."""
    src = tmp_path / "uneven.ckpt"
    ckpt = open_anemoi_checkpoint(LAST)
    names = set(ckpt.root["state_dict"])

    def rename(s: str) -> str:
        if s not in names:
            return s
        return re.sub(r"^model\.model\.processor\.proc\.1\.", "model.model.processor.proc.1.blocks.0.",
                      re.sub(r"^model\.model\.processor\.proc\.0\.", "model.model.processor.proc.0.blocks.1.", s))

    with zipfile.ZipFile(LAST) as z, zipfile.ZipFile(src, "w", zipfile.ZIP_STORED) as out:
        for info in z.infolist():
            data = z.read(info)
            out.writestr(info, _rename_pickle_strings(data, rename) if info.filename.endswith("/data.pkl") else data)
    assert convert_main(["import-anemoi", str(src), "--out", str(tmp_path / "b")]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "uneven chunks" in errors[0], errors


def test_user_defined_names(tmp_path):
    """A dataset named ``era5``, hidden nodes named ``mesh`` and encoder / decoder keys ``enc`` / ``dec``
    (all user-defined in anemoi's config) import as the fixture's ``data`` / ``hidden`` / ``0``."""
    names = set(open_anemoi_checkpoint(LAST).root["state_dict"])
    subs = [("latlons_data", "latlons_era5"), ("latlons_hidden", "latlons_mesh"),
            ("trainable_tensors.data.", "trainable_tensors.era5."), ("trainable_tensors.hidden.", "trainable_tensors.mesh."),
            ("_provider.data.", "_provider.era5."), ("processors.data.", "processors.era5."),
            ("encoder.0.", "encoder.enc."), ("decoder.0.", "decoder.dec.")]

    def rename(s: str) -> str:
        if s in ("data", "hidden"):  # graph node sets, dict keys of the hyper-parameters
            return {"data": "era5", "hidden": "mesh"}[s]
        for old, new in subs if s in names else ():
            s = s.replace(old, new)
        return s

    src = tmp_path / "era5.ckpt"
    with zipfile.ZipFile(LAST) as z, zipfile.ZipFile(src, "w", zipfile.ZIP_STORED) as out:
        for info in z.infolist():
            data = z.read(info)
            if info.filename.endswith("/data.pkl"):
                data = _rename_pickle_strings(data, rename)
            elif info.filename.endswith("anemoi.json"):
                meta = json.loads(data)
                model = meta["config"]["model"]
                meta["data_indices"] = {"era5": meta["data_indices"]["data"]}
                model["model"]["hidden_nodes_name"] = "mesh"
                for section in ("bounding", "residual"):
                    model[section]["datasets"] = {"era5": model[section]["datasets"]["data"]}
                data = json.dumps(meta).encode()
            out.writestr(info, data)
    a, b = read_anemoi(src), read_anemoi(LAST)
    assert a.config == b.config and a.statistics == b.statistics
    assert set(a.weights) == set(b.weights) and all(torch.equal(a.weights[n], b.weights[n]) for n in b.weights)
    for et in b.graph.edge_types:
        assert torch.equal(a.graph[et].edge_index, b.graph[et].edge_index)
        assert torch.equal(a.graph[et].edge_attr, b.graph[et].edge_attr)
