"""``training.compile`` on one GPU: the tiny config trained compiled (inductor, per block) and eager,
fp32 and bf16 autocast (local engine), each run in its own process as launch/train.py would. The
compiled losses equal the eager ones within round-off; the step times are printed (``-s``).
``training.cuda_graphs``: compiled with CUDA graphs (gradient accumulation, validation batches) takes
the compiled run's losses, and inductor recorded every block (no skip). Skipped without CUDA."""

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
from stormshard.models.compile import cuda_graph_skips
print("RESULT", json.dumps({"losses": result.losses, "seconds": seconds, "graph_skips": cuda_graph_skips()}))
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


def _train_pair(dataset: str, tmp_path, changes: dict, variant: dict) -> tuple[dict, dict, list[float], float, float]:  # noqa: ANN001
    """Train the tiny config with ``changes`` and with ``changes`` + ``variant``: both results, the losses'
    relative differences and both median step times (after 2 steps)."""
    from tests.tiny_run import tiny_config

    base = _run(tiny_config(dataset, tmp_path / "base", **changes))
    other = _run(tiny_config(dataset, tmp_path / "variant", **changes, **variant))
    rel = [abs(a - b) / abs(b) for a, b in zip(other["losses"], base["losses"], strict=True)]
    return base, other, rel, _median(base["seconds"][2:]), _median(other["seconds"][2:])


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_compiled_training_on_one_gpu(dataset, tmp_path, precision):
    changes = {"engine": "local", "deepspeed": {}, "training.max_steps": 8, "training.lr": 3e-3,
               "training.precision": precision}
    eager, compiled, rel, e, c = _train_pair(dataset, tmp_path, changes, {"training.compile": True})
    print(f"{precision}: first step eager {eager['seconds'][0]:.2f} s, compiled {compiled['seconds'][0]:.2f} s "
          f"(compile); median step eager {e * 1e3:.1f} ms, compiled {c * 1e3:.1f} ms (eager / compiled {e / c:.2f}x); "
          f"loss: max relative difference {max(rel):.1e}")
    assert max(rel) < (1e-4 if precision == "fp32" else 2e-2)


def test_cuda_graphs_training_on_one_gpu(dataset, tmp_path):
    """bf16, 2 micro-batches per step, validation every 4 steps: the graphed run replays what the compiled run
    computes (the same kernels), so the losses agree to round-off; every compiled block was recorded."""
    changes = {"engine": "local", "deepspeed": {}, "training.max_steps": 8, "training.lr": 3e-3,
               "training.precision": "bf16", "training.compile": True, "training.gradient_accumulation_steps": 2,
               "training.validation_interval": 4, "data.validation_samples": 2}
    compiled, graphed, rel, c, g = _train_pair(dataset, tmp_path, changes, {"training.cuda_graphs": True})
    print(f"cuda graphs: first step {graphed['seconds'][0]:.2f} s; median step compiled {c * 1e3:.1f} ms, with CUDA "
          f"graphs {g * 1e3:.1f} ms ({c / g:.2f}x); graph skips {graphed['graph_skips']}; loss: max relative "
          f"difference {max(rel):.1e}")
    assert graphed["graph_skips"] == 0
    assert max(rel) < 1e-3
