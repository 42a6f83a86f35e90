"""``training.compile`` on one GPU: the tiny config trained compiled (inductor, per block) and eager,
fp32 and bf16 autocast (local engine), each run in its own process as launch/train.py would. The
compiled losses equal the eager ones within round-off; the step times are printed (``-s``).
Skipped without CUDA."""

from __future__ import annotations

import pytest

from tests.gpu.test_cuda_training import _run as run_training_process

RUN = """
import json, sys, time
import torch
from stormshard.training import loop
from stormshard.training.launch import run_training
cfg = json.loads(sys.argv[1])
seconds = []
original = loop.Trainer.train_step
def timed(self, *args, **kwargs):
    torch.cuda.synchronize()
    tic = time.perf_counter()
    out = original(self, *args, **kwargs)
    torch.cuda.synchronize()
    seconds.append(time.perf_counter() - tic)
    return out
loop.Trainer.train_step = timed
result = run_training(cfg)
print("RESULT", json.dumps({"losses": result.losses, "seconds": seconds}))
"""


def _run(cfg: dict) -> dict:
    # inductor (the CPU tests' STORMSHARD_COMPILE_BACKEND unset)
    return run_training_process(cfg, RUN, port=29700, STORMSHARD_COMPILE_BACKEND="")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    from stormshard.data.synthetic import generate_synthetic_dataset

    path = tmp_path_factory.mktemp("gpu_compile_data") / "synthetic.zarr"
    generate_synthetic_dataset(path, grid="o8", steps=64, seed=1)
    return str(path)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_training_on_one_gpu(dataset, tmp_path, precision):
    from tests.tiny_run import tiny_config

    changes = {"engine": "local", "deepspeed": {}, "training.max_steps": 8, "training.lr": 3e-3,
               "training.precision": precision}
    eager = _run(tiny_config(dataset, tmp_path / "eager", **changes))
    compiled = _run(tiny_config(dataset, tmp_path / "compiled", **changes, **{"training.compile": True}))
    rel = [abs(a - b) / abs(b) for a, b in zip(compiled["losses"], eager["losses"], strict=True)]
    e, c = _median(eager["seconds"][2:]), _median(compiled["seconds"][2:])
    print(f"{precision}: first step eager {eager['seconds'][0]:.2f} s, compiled {compiled['seconds'][0]:.2f} s "
          f"(compile); median step eager {e * 1e3:.1f} ms, compiled {c * 1e3:.1f} ms (eager / compiled {e / c:.2f}x); "
          f"loss: max relative difference {max(rel):.1e}")
    assert max(rel) < (1e-4 if precision == "fp32" else 2e-2)
