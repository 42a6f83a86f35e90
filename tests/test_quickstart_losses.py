"""The quickstart configs' loss curves, pinned: a refactor that changes no math changes no loss.

Every ``configs/quickstart*.json`` trains 4 steps on 2 gloo ranks (its own layout, engine and
model) on a small generated O8 dataset; the per-step losses must equal the curve recorded in
``tests/data/quickstart_losses.json``. On a CPU of the recording's kind (the same
``torch.backends.cpu.get_cpu_capability()``, CPU model and torch version) they must be bit-identical; on
another CPU the kernels differ (AVX2 vs AVX-512 reductions; an Intel Xeon and an AMD EPYC, both AVX-512,
differ in the last bits from the first step), so they must agree to 1e-5.

Record again (only when the math is meant to change, and say why in the commit)::

    OMP_NUM_THREADS=1 python -m tests.test_quickstart_losses --record
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from stormshard.data.synthetic import generate_synthetic_dataset

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "data" / "quickstart_losses.json"
CONFIGS = sorted(p.stem for p in (ROOT / "configs").glob("quickstart*.json"))
STEPS = 4
WORLD = 2


def shrink(raw: dict[str, Any], dataset: str, sea_dataset: str, out: Path) -> dict[str, Any]:
    """``raw`` on the small dataset: 4 steps, dates inside the O8 store, no progress bar."""
    cfg = copy.deepcopy(raw)
    data = cfg["data"]
    data["path"] = sea_dataset if "imputation" in data else dataset
    data["train"] = {"start": None, "end": "2020-01-10T18"}
    data["validation"] = {"start": "2020-01-11", "end": None}
    if "test" in data:
        data["validation"]["end"] = "2020-01-12T18"
        data["test"] = {"start": "2020-01-13", "end": None}
    data["validation_samples"] = 2
    training = cfg["training"]
    training.update(max_steps=STEPS, warmup_steps=1, validation_interval=100, checkpoint_interval=100,
                    output_dir=str(out))
    if isinstance(training.get("rollout"), dict):
        training["rollout"] = {**training["rollout"], "increase_every": 2, "maximum": 2}
    cfg["logging"] = {**cfg.get("logging", {}), "progress": False, "wandb": False}
    return cfg


def make_datasets(folder: Path) -> tuple[str, str]:
    plain, sea = folder / "synthetic.zarr", folder / "synthetic_sst.zarr"
    generate_synthetic_dataset(plain, grid="o8", steps=64, seed=1)
    generate_synthetic_dataset(sea, grid="o8", steps=64, seed=1, sea_field=True)
    return str(plain), str(sea)


def _train(rank: int, world: int, cfg: dict[str, Any]) -> list[float]:
    from stormshard.training.launch import run_training

    return [float(x) for x in run_training(cfg).losses]


def losses_of(name: str, dataset: str, sea: str, out: Path) -> list[float]:
    from tests.distributed import run_distributed

    raw = json.loads((ROOT / "configs" / f"{name}.json").read_text())
    return run_distributed(_train, WORLD, shrink(raw, dataset, sea, out), timeout=600)[0]


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor string elsewhere): two CPUs of the
    same capability (AVX512 on an Intel Xeon and an AMD EPYC) pick different MKL / oneDNN kernels."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor()


def machine() -> dict[str, str]:
    return {"cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu": _cpu_model(),
            "torch": torch.__version__.split("+")[0]}


@pytest.fixture(scope="module")
def datasets(tmp_path_factory) -> tuple[str, str]:
    return make_datasets(tmp_path_factory.mktemp("quickstart_data"))


@pytest.mark.parametrize("name", CONFIGS)
def test_quickstart_loss_curve_unchanged(name, datasets, tmp_path):
    golden = json.loads(GOLDEN.read_text())
    if name not in golden["losses"]:
        pytest.fail(f"{name}.json has no recorded curve in {GOLDEN}: record it (see this module's docstring)")
    expected = [float.fromhex(h) for h in golden["losses"][name]]
    got = losses_of(name, *datasets, tmp_path / "run")
    assert len(got) == len(expected)
    if machine() == golden["machine"]:
        assert [x.hex() for x in got] == golden["losses"][name], (got, expected)
    else:
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(got, expected, strict=True)), (got, expected)


if __name__ == "__main__" and "--record" in sys.argv:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        plain, sea_store = make_datasets(Path(tmp))
        record = {"machine": machine(), "steps": STEPS, "world": WORLD,
                  "losses": {n: [x.hex() for x in losses_of(n, plain, sea_store, Path(tmp) / n)] for n in CONFIGS}}
    GOLDEN.parent.mkdir(exist_ok=True)
    GOLDEN.write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))
