"""Forecast throughput: forecast steps per second and peak memory per rank at 1 and 2 processes
for the O48 config (configs/o48_cpu.json: 10,944 cells, O24 hidden, 128 channels).

A model of that config is trained for one step on a small synthetic O48 dataset (one process,
engine local) to get a checkpoint; each case then runs ``run_forecast`` from it under torchrun
(``benchmarks/_forecast_probe.py``), without scores:

- world 1: one process holds the whole model;
- world 2, gpus_per_model 2: the model sharded over both processes (each holds half the grid);
- world 2, gpus_per_model 1: two replicas, the initial dates dealt between them.

Forecast steps per second = (initial dates x members x lead steps) / the rollout's wall time
(reading the inputs, the sharded rollout and the zarr region writes; barrier to barrier). Peak
memory: each rank's ``ru_maxrss`` (host RSS; ``torch.cuda.max_memory_allocated`` on GPUs).
Ratios are against world 1 in the same run. ``--quick``: 2 initial dates x 2 steps.

    python benchmarks/bench_forecast.py [--quick] [--precision fp32|bf16] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = [(1, 1), (2, 2), (2, 1)]  # (world, gpus_per_model)


def _checkpoint(work: Path, dates: int, steps: int) -> tuple[Path, Path]:
    from stormshard.data.synthetic import generate_synthetic_dataset
    from stormshard.training.launch import run_training

    dataset = work / "o48.zarr"
    generate_synthetic_dataset(dataset, grid="o48", steps=8 + dates + steps, seed=0)
    cfg = json.loads((ROOT / "configs" / "o48_cpu.json").read_text())
    cfg = copy.deepcopy(cfg)
    cfg["data"].update(path=str(dataset), train={"start": None, "end": "2020-01-02T18"},
                       validation={"start": "2020-01-03T00", "end": None}, validation_samples=1)
    cfg["parallel"] = {"gpus_per_model": 1}
    cfg["training"].update(output_dir=str(work / "run"), max_steps=1, warmup_steps=0, validation_interval=100,
                           checkpoint_interval=100, micro_batch_size=1)
    cfg["engine"] = "local"
    cfg.pop("deepspeed", None)
    cfg["logging"] = {"progress": False, "wandb": False}
    run_training(cfg)
    return work / "run" / "checkpoints", dataset


def _run_case(world: int, k: int, model: Path, dataset: Path, dates: list[str], steps: int, precision: str,
              work: Path) -> list[dict]:
    result = work / f"case_w{world}_k{k}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(world),
           str(ROOT / "benchmarks" / "_forecast_probe.py"), "--model", str(model), "--dataset", str(dataset),
           "--dates", *dates, "--steps", str(steps), "--gpus-per-model", str(k), "--precision", precision,
           "--out", str(work / f"fc_w{world}_k{k}"), "--result", str(result)]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return [json.loads(Path(f"{result}.rank{r}").read_text()) for r in range(world)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--out", default=None, help="results folder (default: benchmarks/results; with --quick a "
                   "temporary folder, so a quick run never replaces the published numbers)")
    a = p.parse_args()
    if a.out is None:
        a.out = tempfile.mkdtemp(prefix="bench_forecast_out_") if a.quick else str(ROOT / "benchmarks" / "results")
    n_dates, steps = (2, 2) if a.quick else (4, 4)
    with tempfile.TemporaryDirectory(prefix="bench_forecast_") as tmp:
        work = Path(tmp)
        model, dataset = _checkpoint(work, n_dates, steps)
        dates = [f"2020-01-03T{6 * i:02d}" for i in range(n_dates)]
        rows = []
        for world, k in CASES:
            ranks = _run_case(world, k, model, dataset, dates, steps, a.precision, work)
            rows.append({"world": world, "gpus_per_model": k, "steps_per_s": ranks[0]["steps_per_s"],
                         "rollout_s": ranks[0]["rollout_s"], "forecast_steps": ranks[0]["forecast_steps"],
                         "peak_rss_mib": [round(r["peak_rss_mib"], 1) for r in ranks]})
    base = rows[0]
    print(f"O48 forecast ({n_dates} dates x {steps} steps, {a.precision}, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '1')})")
    print(f"{'layout':<28}{'steps/s':>10}{'vs world 1':>12}  peak RSS per rank (MiB)")
    for r in rows:
        name = f"world {r['world']}, gpus_per_model {r['gpus_per_model']}"
        ratio = r["steps_per_s"] / base["steps_per_s"]
        print(f"{name:<28}{r['steps_per_s']:>10.3f}{ratio:>11.2f}x  {r['peak_rss_mib']}")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "forecast.json").write_text(json.dumps({"quick": a.quick, "precision": a.precision, "dates": n_dates,
                                                   "steps": steps, "cases": rows}, indent=1))


if __name__ == "__main__":
    main()
