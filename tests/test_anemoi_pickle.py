"""Reading anemoi checkpoints without anemoi and without executing anything in them.

Fixtures: ``tests/fixtures/anemoi/<variant>/inference.ckpt``, written by anemoi-training's own
checkpoint callback (``tests/fixtures/anemoi/make_fixtures.py``, run in the anemoi-training venv).
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from stormshard.checkpoint.anemoi_pickle import (
    NotAnemoiCheckpoint,
    UnsafeAnemoiCheckpoint,
    module_tensors,
    open_anemoi_checkpoint,
)

FIXTURES = Path(__file__).parent / "fixtures" / "anemoi"
VARIANTS = ("gt", "transformer", "gt_truncated", "gt_bounded", "gnn")


def _probe(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (so ``sys.modules`` shows what it imported); its last line as JSON."""
    import json

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("variant", VARIANTS)
def test_fixture_loads_without_anemoi(variant):
    """In a fresh interpreter: every tensor, the metadata and the supporting arrays are read, and
    neither anemoi nor torch_geometric (nor hydra / omegaconf) gets imported."""
    code = (
        "import sys, json\n"
        "from stormshard.checkpoint.anemoi_pickle import open_anemoi_checkpoint, module_tensors\n"
        f"c = open_anemoi_checkpoint({str(FIXTURES / variant / 'inference.ckpt')!r})\n"
        "t = module_tensors(c.root, persistent_only=True)\n"
        "print(json.dumps({'kind': c.kind, 'n': len(t), 'numel': sum(x.numel() for x in t.values()),\n"
        "  'version': c.metadata['version'], 'arrays': sorted(c.supporting_arrays),\n"
        "  'imported': sorted(m for m in ('anemoi', 'torch_geometric', 'hydra', 'omegaconf') if m in sys.modules)}))\n"
    )
    info = _probe(code)
    assert info["kind"] == "inference"
    assert info["imported"] == []
    assert info["arrays"] == ["data/latitudes", "data/longitudes"]
    assert info["version"].startswith("2")
    assert info["n"] > 50


@pytest.mark.parametrize("variant", VARIANTS)
def test_every_tensor_found(variant):
    """Every tensor the pickle holds is reached through the module tree: the storages of the
    file are all referenced by the tensors found (nothing left unread)."""
    path = FIXTURES / variant / "inference.ckpt"
    ckpt = open_anemoi_checkpoint(path)
    tensors = module_tensors(ckpt.root)
    with zipfile.ZipFile(path) as z:
        entries = {n.rsplit("/", 1)[1] for n in z.namelist() if n.split("/")[1:2] == ["data"]}
    assert ckpt.storages_read == entries  # every storage of the file belongs to some tensor
    assert all(t.numel() == 0 or torch.isfinite(t.float()).all() for t in tensors.values())
    for name in ("model.node_attributes.trainable_tensors.data.trainable",
                 "pre_processors.data.processors.normalizer._norm_mul"):
        assert name in tensors


def test_lightning_fixture_loads_without_anemoi():
    """``last.ckpt`` (Lightning, anemoi-training 0.17): in a fresh interpreter the state dict, the
    optimizer states, the graph (a stubbed ``HeteroData``) and the metadata are read, every storage of
    the file is referenced, and neither anemoi, torch_geometric, omegaconf nor Lightning gets imported."""
    path = FIXTURES / "gt" / "last.ckpt"
    code = (
        "import sys, json, zipfile\n"
        "from stormshard.checkpoint.anemoi_pickle import open_anemoi_checkpoint\n"
        f"c = open_anemoi_checkpoint({str(path)!r})\n"
        "sd, hp = c.root['state_dict'], c.root['hyper_parameters']\n"
        "edges = hp['graph_data'].__dict__['_edge_store_dict']\n"
        "z = zipfile.ZipFile(c.path)\n"
        "entries = {n.rsplit('/', 1)[1] for n in z.namelist() if n.split('/')[1:2] == ['data']}\n"
        "print(json.dumps({'kind': c.kind, 'n': len(sd), 'version': c.metadata['version'],\n"
        "  'optimizer': len(c.root['optimizer_states'][0]['state']), 'edges': len(edges),\n"
        "  'all_storages': c.storages_read == entries, 'step': c.root['global_step'],\n"
        "  'imported': sorted(m for m in ('anemoi', 'torch_geometric', 'hydra', 'omegaconf', 'pytorch_lightning',\n"
        "                                 'lightning') if m in sys.modules)}))\n"
    )
    info = _probe(code)
    assert info == {"kind": "lightning", "n": info["n"], "version": "2.0", "optimizer": info["optimizer"],
                    "edges": 3, "all_storages": True, "step": 2, "imported": []}
    assert info["n"] > 100 and info["optimizer"] > 50


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch PWNED_BY_PICKLE",))


def _torch_zip_with(obj, path: Path, metadata: bool = True) -> None:
    torch.save(obj, path)
    if metadata:
        with zipfile.ZipFile(path, "a") as z:
            folder = z.namelist()[0].split("/")[0]
            z.writestr(f"{folder}/anemoi-metadata/anemoi.json", '{"version": "2.0"}')


def test_malicious_reduce_does_not_execute(tmp_path, monkeypatch):
    """A pickle naming os.system is refused (naming it), and nothing in it runs."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "evil.ckpt"
    _torch_zip_with({"state_dict": {"w": torch.ones(2)}, "payload": _Evil()}, path)
    with pytest.raises(UnsafeAnemoiCheckpoint, match=r"names (posix|nt)\.system \(os\.system\) in its pickle"):
        open_anemoi_checkpoint(path)
    assert not (tmp_path / "PWNED_BY_PICKLE").exists()


def test_not_anemoi_files_are_clear_errors(tmp_path):
    plain = tmp_path / "plain.pt"
    _torch_zip_with({"a": torch.ones(1)}, plain, metadata=False)
    with pytest.raises(NotAnemoiCheckpoint, match="not an anemoi checkpoint"):
        open_anemoi_checkpoint(plain)
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(NotAnemoiCheckpoint, match="not a torch zip file"):
        open_anemoi_checkpoint(text)
    old = tmp_path / "legacy.pt"
    with open(old, "wb") as f:
        pickle.dump({"a": 1}, f)
    with pytest.raises(NotAnemoiCheckpoint):
        open_anemoi_checkpoint(old)
    with pytest.raises(NotAnemoiCheckpoint, match="no such file"):
        open_anemoi_checkpoint(tmp_path / "missing.ckpt")
