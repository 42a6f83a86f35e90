"""End-to-end training throughput: samples/s, step time and per-rank peak memory per parallel
layout, weak-scaling efficiency, and PowerSGD against exact all-reduce.

Every case is a separate multi-process job started with the DeepSpeed launcher
(``deepspeed --num_accelerators N``; ``--launcher torchrun`` for torchrun) on a temporary config
derived from a shipped one (``configs/quickstart.json``, ``configs/o48_cpu.json``; the shipped
files are never changed). Each rank runs ``benchmarks/_train_probe.py`` (the library's own
``preflight -> init_distributed -> Trainer.fit`` plus outside measurements):

- step time: rank 0's ``step_time`` in ``metrics.jsonl`` (the loop's wall time of one optimizer
  step: read, forward, backward, gradient reduction, optimizer), median over the steps after the
  first ``--warmup``; samples/s = effective batch / median step time (the logger's own
  ``samples_per_s`` median is kept beside it);
- peak memory per rank: each rank's ``getrusage(RUSAGE_SELF).ru_maxrss`` at exit (host RSS,
  includes the final validation and checkpoint; on GPUs also ``torch.cuda.max_memory_allocated``);
- bytes: the PowerSGD compressor's ``bytes_per_step()`` (compressed and exact, ring all-reduce
  accounting) or, without compression, the ring all-reduce bytes of the rank's gradients; and
  stormshard's ``CommCounter`` over the measured steps (model-parallel collectives, PowerSGD).

Scaling (as the AIFS data-parallel poster plots it):

- weak scaling, data parallel: micro batch per replica fixed (fixed work per process),
  ``E = T1 / TN`` with ``T`` the median step time at N processes (gpus_per_model 1); and from
  (world 2, gpus_per_model 2) to (world 4, gpus_per_model 2) (2 -> 4 processes, 1 -> 2 replicas);
- model sharding (gpus_per_model 2) splits one sample's work over the processes, so the work per
  process shrinks: it is reported as a strong-scaling speed-up ``T(world 1) / T(world 2, gpm 2)``.

With ``OMP_NUM_THREADS=1`` a process uses one core. On a 2-core machine 4 processes
oversubscribe the CPU and E falls to about 0.5 for that reason alone; the JSON marks those
cases, and records the load average (the machine may be shared) around every case.

    python benchmarks/bench_training.py [--quick] [--launcher deepspeed|torchrun] [--out benchmarks/results]

Writes ``<out>/training.json`` and ``<out>/training.png``.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PROBE = ROOT / "benchmarks" / "_train_probe.py"
PYTHON = Path(sys.executable)
CONFIGS = {"quickstart": "configs/quickstart.json", "o48": "configs/o48_cpu.json"}
O48_DATA = "data/synthetic_o48.zarr"


@dataclass(frozen=True)
class Case:
    """One multi-process job."""

    name: str
    config: str  # key of CONFIGS
    world: int
    gpus_per_model: int
    engine: str = "deepspeed"  # "deepspeed" or "ddp"
    zero_stage: int | None = None  # None: the shipped config's
    compression: bool = False
    steps: int = 15
    micro_batch: int = 2


def _cases(quick: bool, configs: list[str]) -> list[Case]:
    q_steps, o_steps = (9, 7) if quick else (15, 9)
    out: list[Case] = []
    for cfg in configs:
        # O48 (10,944 cells, 128 channels) takes ~2 s per sample per core: micro batch 1 keeps the
        # 4-process cases within the time budget; the quickstart keeps its shipped micro batch 2
        steps, micro = (q_steps, 2) if cfg == "quickstart" else (o_steps, 1)
        layouts = [(1, 1), (2, 1), (4, 1), (2, 2)] if quick else [(1, 1), (2, 1), (4, 1), (2, 2), (4, 2)]
        for world, gpm in layouts:
            out.append(Case(f"{cfg}/w{world}-gpm{gpm}", cfg, world, gpm, steps=steps, micro_batch=micro))
    comp = [("ddp", None)] if quick else [("ddp", None), ("deepspeed", 0)]
    for engine, zero in comp:
        for compress in (False, True):
            tag = f"{engine}{'' if zero is None else f'-zero{zero}'}-{'powersgd' if compress else 'exact'}"
            out.append(Case(f"quickstart/w2-dp/{tag}", "quickstart", 2, 1, engine=engine, zero_stage=zero,
                            compression=compress, steps=q_steps))
    return out


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_config(case: Case, workdir: Path, warmup: int) -> Path:
    """A temporary config: the shipped one with the case's layout, engine and short schedule."""
    raw = json.loads((ROOT / CONFIGS[case.config]).read_text())
    cfg = copy.deepcopy(raw)
    run_dir = workdir / case.name.replace("/", "_")
    shutil.rmtree(run_dir / "output", ignore_errors=True)  # a kept (--keep) earlier run: train refuses to reuse it
    cfg["name"] = f"bench_{case.name.replace('/', '_')}"
    cfg["parallel"] = {"gpus_per_model": case.gpus_per_model, "shard_strategy": "shard_sequence",
                       "read_group_size": case.gpus_per_model}
    cfg["training"].update(max_steps=case.steps, validation_interval=10**9, checkpoint_interval=10**9,
                           warmup_steps=min(5, case.steps), output_dir=str(run_dir / "output"))
    data_path = cfg["data"]["path"]
    cfg["data"].update(path=str(ROOT / data_path), graph_cache=str(workdir / f"graph_{case.config}.pt"),
                       validation_samples=2)
    cfg["logging"] = {"progress": False, "wandb": False, "log_interval": 1}
    cfg["training"].update(micro_batch_size=case.micro_batch, gradient_accumulation_steps=1)
    ds = dict(cfg.get("deepspeed", {}))
    if case.zero_stage is not None:
        ds["zero_optimization"] = {"stage": case.zero_stage}
    cfg["engine"] = case.engine
    if case.engine == "ddp":
        ds = {}  # DeepSpeed's own settings only: micro batch, clipping and AdamW are engine-neutral
        cfg["ddp"] = {"bucket_cap_mb": 25, "broadcast_buffers": False}
    cfg["deepspeed"] = ds
    if case.compression:
        # PowerSGD from the step the measurement starts at (exact all-reduce before start_iter)
        cfg["compression"] = {"type": "powersgd", "rank": 4, "start_iter": max(1, warmup - 1)}
    else:
        cfg.pop("compression", None)
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def _command(case: Case, config: Path, report: Path, warmup: int, launcher: str) -> list[str]:
    port = str(_free_port())
    args = [str(PROBE), "--config", str(config), "--report_dir", str(report), "--warmup", str(warmup)]
    if launcher == "torchrun":
        return [str(PYTHON.parent / "torchrun"), "--nproc_per_node", str(case.world), "--master_addr", "127.0.0.1",
                "--master_port", port, *args]
    return [str(PYTHON.parent / "deepspeed"), "--master_port", port, "--num_accelerators", str(case.world), *args]


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def _run_case(case: Case, workdir: Path, warmup: int, launcher: str, timeout: float) -> dict[str, Any]:
    config = _write_config(case, workdir, warmup)
    run_dir = config.parent
    report = run_dir / "ranks"
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"),
               TORCH_EXTENSIONS_DIR=os.environ.get("TORCH_EXTENSIONS_DIR", str(ROOT / ".cache" / "torch_extensions")),
               PYTHONPATH=str(ROOT))
    load_before = os.getloadavg()
    tic = time.perf_counter()
    result: dict[str, Any] = {**asdict(case), "launcher": launcher, "warmup_steps": warmup,
                              "oversubscribed": case.world > (os.cpu_count() or 1)}
    with open(run_dir / "log.txt", "w") as log:
        try:
            proc = subprocess.run(_command(case, config, report, warmup, launcher), cwd=ROOT, env=env,
                                  stdout=log, stderr=subprocess.STDOUT, timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    result.update(wall_s=time.perf_counter() - tic, load_before=load_before, load_after=os.getloadavg(),
                  returncode=rc)
    ranks = sorted(report.glob("rank*.json"), key=lambda p: int(p.stem[4:])) if report.exists() else []
    metrics_path = run_dir / "output" / "metrics.jsonl"
    if rc != 0 or len(ranks) != case.world or not metrics_path.exists():
        tail = (run_dir / "log.txt").read_text().splitlines()[-15:]
        result["error"] = "\n".join(tail)
        print(f"  FAILED ({rc}): see {run_dir / 'log.txt'}\n    " + "\n    ".join(tail[-5:]), flush=True)
        return result
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    train = [r for r in records if "step_time" in r and r["step"] > warmup]
    per_rank = [json.loads(p.read_text()) for p in ranks]
    step_times = [r["step_time"] for r in train]
    median = _median(step_times)
    eff = per_rank[0]["effective_batch"]
    result.update(
        data_parallel_size=per_rank[0]["data_parallel_size"],
        effective_batch=eff,
        measured_steps=len(step_times),
        step_time_median_s=median,
        step_time_min_s=min(step_times) if step_times else None,
        step_time_max_s=max(step_times) if step_times else None,
        samples_per_s=eff / median if median else None,
        logger_samples_per_s_median=_median([r["samples_per_s"] for r in train if r.get("samples_per_s")]),
        final_loss=train[-1]["loss"] if train else None,
        peak_rss_mib_per_rank=[r["max_rss_mib"] for r in per_rank],
        cuda_max_allocated_mib_per_rank=[r["cuda_max_allocated_mib"] for r in per_rank],
        trainable_numel_per_rank=[r["trainable_numel"] for r in per_rank],
        grad_allreduce_bytes_per_step=per_rank[0]["grad_allreduce_bytes_per_step"],
        stormshard_comm_per_step_rank0=per_rank[0]["stormshard_comm_per_step"],
    )
    return result


# ---------------------------------------------------------------------------------- analysis
def _find(runs: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    for r in runs:
        if r["name"] == name and r.get("step_time_median_s"):
            return r
    return None


def _scaling(runs: list[dict[str, Any]], configs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cores = os.cpu_count() or 1
    for cfg in configs:
        base = _find(runs, f"{cfg}/w1-gpm1")
        entry: dict[str, Any] = {"weak_data_parallel": [], "weak_data_parallel_sharded": [], "model_sharding": []}
        if base:
            t1 = base["step_time_median_s"]
            for n in (1, 2, 4):
                r = _find(runs, f"{cfg}/w{n}-gpm1")
                if r:
                    entry["weak_data_parallel"].append({
                        "processes": n, "step_time_s": r["step_time_median_s"],
                        "efficiency": t1 / r["step_time_median_s"],
                        "efficiency_from_fastest_steps": base["step_time_min_s"] / r["step_time_min_s"],
                        "samples_per_s": r["samples_per_s"], "oversubscribed": n > cores})
            r2 = _find(runs, f"{cfg}/w2-gpm2")
            if r2:
                entry["model_sharding"].append({
                    "processes": 2, "gpus_per_model": 2, "step_time_s": r2["step_time_median_s"],
                    "strong_speedup": t1 / r2["step_time_median_s"],
                    "strong_efficiency": t1 / r2["step_time_median_s"] / 2})
        r2, r4 = _find(runs, f"{cfg}/w2-gpm2"), _find(runs, f"{cfg}/w4-gpm2")
        if r2 and r4:
            entry["weak_data_parallel_sharded"].append({
                "from_processes": 2, "to_processes": 4, "gpus_per_model": 2,
                "efficiency": r2["step_time_median_s"] / r4["step_time_median_s"],
                "efficiency_from_fastest_steps": r2["step_time_min_s"] / r4["step_time_min_s"],
                "oversubscribed": 4 > cores})
        out[cfg] = entry
    return out


def _compression(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for engine in ("ddp", "deepspeed-zero0"):
        exact = _find(runs, f"quickstart/w2-dp/{engine}-exact")
        psgd = _find(runs, f"quickstart/w2-dp/{engine}-powersgd")
        if not (exact and psgd):
            continue
        b = psgd["grad_allreduce_bytes_per_step"]
        out.append({
            "engine": engine,
            "exact_bytes_per_step": exact["grad_allreduce_bytes_per_step"]["exact"],
            "powersgd_bytes_per_step": b["compressed"],
            "bytes_ratio": b["exact"] / b["compressed"] if b["compressed"] else None,
            "powersgd_allreduce_calls": b["compressed_calls"],
            "powersgd_measured_comm_bytes_per_step": sum(
                v["bytes"] for v in psgd["stormshard_comm_per_step_rank0"].values()),
            "exact_step_time_s": exact["step_time_median_s"],
            "powersgd_step_time_s": psgd["step_time_median_s"],
            "step_time_ratio": psgd["step_time_median_s"] / exact["step_time_median_s"],
            "exact_final_loss": exact["final_loss"],
            "powersgd_final_loss": psgd["final_loss"],
        })
    return out


# ---------------------------------------------------------------------------------- output
def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows, strict=True)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"  # noqa: E731
    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def _fmt(x: Any, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def report_tables(result: dict[str, Any]) -> str:
    runs = result["runs"]
    rows = []
    for r in runs:
        if "error" in r:
            rows.append([r["name"], str(r["world"]), str(r["gpus_per_model"]), "-", "-", "-", "FAILED", "-"])
            continue
        rows.append([r["name"], str(r["world"]), str(r["gpus_per_model"]), str(r["data_parallel_size"]),
                     str(r["effective_batch"]), f"{r['step_time_median_s']:.3f} ({r['step_time_min_s']:.3f})",
                     _fmt(r["samples_per_s"], ".2f"),
                     " / ".join(f"{m:.0f}" for m in r["peak_rss_mib_per_rank"])
                     + (" (oversubscribed)" if r["oversubscribed"] else "")])
    parts = [_table(rows, ["case", "world", "gpm", "dp", "batch", "step s median (min)", "samples/s",
                           "peak RSS MiB per rank"])]
    srows = []
    for cfg, s in result["scaling"].items():
        for e in s["weak_data_parallel"]:
            srows.append([cfg, f"weak, data parallel 1 -> {e['processes']}", _fmt(e["step_time_s"]),
                          f"E = {e['efficiency']:.2f} (fastest steps: {e['efficiency_from_fastest_steps']:.2f})"
                          + (", 4 procs on 2 cores" if e["oversubscribed"] else "")])
        for e in s["weak_data_parallel_sharded"]:
            srows.append([cfg, "weak, gpm 2: 2 -> 4 processes", "-",
                          f"E = {e['efficiency']:.2f} (fastest steps: {e['efficiency_from_fastest_steps']:.2f})"
                          + (", 4 procs on 2 cores" if e["oversubscribed"] else "")])
        for e in s["model_sharding"]:
            srows.append([cfg, "strong, model sharding 1 -> 2 (gpm 2)", _fmt(e["step_time_s"]),
                          f"speed-up {e['strong_speedup']:.2f} (efficiency {e['strong_efficiency']:.2f})"])
    if srows:
        parts.append(_table(srows, ["config", "scaling", "step s (N)", "result"]))
    crows = [[c["engine"], f"{c['exact_bytes_per_step']:,}", f"{c['powersgd_bytes_per_step']:,}",
              _fmt(c["bytes_ratio"], ".1f") + "x", str(c["powersgd_allreduce_calls"]), _fmt(c["exact_step_time_s"]),
              _fmt(c["powersgd_step_time_s"]), _fmt(c["step_time_ratio"], ".2f")]
             for c in result["compression"]]
    if crows:
        parts.append(_table(crows, ["engine (world 2, dp)", "exact B/step", "PowerSGD B/step", "fewer bytes",
                                    "PowerSGD calls", "exact step s", "PowerSGD step s", "time ratio"]))
    return "\n\n".join(parts)


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in result["runs"] if r.get("step_time_median_s")]
    layout_runs = [r for r in runs if r["name"].count("/") == 1]
    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    ax = axes[0, 0]
    labels = [r["name"] for r in layout_runs]
    colors = ["tab:red" if r["oversubscribed"] else "tab:blue" for r in layout_runs]
    ax.barh(labels, [r["samples_per_s"] for r in layout_runs], color=colors)
    ax.invert_yaxis()
    ax.set_xlabel("samples/s (red: more processes than cores)")
    ax.set_title("Throughput per layout")

    ax = axes[0, 1]
    for cfg, s in result["scaling"].items():
        pts = s["weak_data_parallel"]
        if pts:
            ax.plot([p["processes"] for p in pts], [p["efficiency"] for p in pts], "o-", label=f"{cfg}, data parallel")
    ax.axhline(1.0, color="grey", ls="--", lw=1, label="ideal")
    cores = result["machine"]["cpu_count"]
    ax.axvspan(cores + 0.5, 4.5, color="tab:red", alpha=0.1, label=f"> {cores} cores (oversubscribed)")
    ax.set_xticks([1, 2, 4])
    ax.set_ylim(0, 1.2)
    ax.set_xlabel("processes (micro batch per process fixed)")
    ax.set_ylabel("E = T1 / TN")
    ax.set_title("Weak-scaling efficiency")
    ax.legend(fontsize=8)

    ax = axes[1, 0]
    for i, r in enumerate(layout_runs):
        rss = r["peak_rss_mib_per_rank"]
        ax.scatter([i] * len(rss), rss, color="tab:blue" if r["gpus_per_model"] == 1 else "tab:green", s=18)
    ax.set_xticks(range(len(layout_runs)))
    ax.set_xticklabels(labels, rotation=45, ha="right", fontsize=7)
    ax.set_ylim(bottom=0)
    ax.set_ylabel("peak RSS per rank (MiB)")
    ax.set_title("Per-rank peak memory (blue: gpm 1, green: gpm 2)")

    ax = axes[1, 1]
    comp = result["compression"]
    if comp:
        x = range(len(comp))
        ax.bar([i - 0.2 for i in x], [c["exact_bytes_per_step"] / 1e3 for c in comp], 0.4, label="exact all-reduce")
        ax.bar([i + 0.2 for i in x], [c["powersgd_bytes_per_step"] / 1e3 for c in comp], 0.4, label="PowerSGD")
        ax.set_xticks(list(x))
        ax.set_xticklabels([f"{c['engine']}\nstep {c['exact_step_time_s']:.3f}s vs {c['powersgd_step_time_s']:.3f}s"
                            for c in comp], fontsize=8)
        ax.set_ylabel("gradient kB sent per rank per step")
        ax.legend(fontsize=8)
    ax.set_title("PowerSGD vs exact all-reduce (world 2, data parallel)")
    fig.suptitle(f"stormshard training benchmark ({result['machine']['note']})", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="quickstart only, fewer layouts and steps (~3 min)")
    parser.add_argument("--launcher", choices=("deepspeed", "torchrun"), default="deepspeed")
    parser.add_argument("--warmup", type=int, default=3, help="first optimizer steps left out of the timing")
    parser.add_argument("--out", default=None,
                        help="results folder (default: benchmarks/results; with --quick a temporary folder, "
                        "so a quick run never replaces the published numbers)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument("--keep", default=None, help="keep the per-case configs, logs and metrics in this folder")
    parser.add_argument("--only", default=None, help="run only the cases whose name contains this string")
    parser.add_argument("--replot", action="store_true", help="redraw the chart and tables from <out>/training.json")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = tempfile.mkdtemp(prefix="bench_training_") if args.quick and not args.replot else \
            str(ROOT / "benchmarks" / "results")
    if args.replot:
        result = json.loads((Path(args.out) / "training.json").read_text())
        plot(result, Path(args.out) / "training.png")
        print(report_tables(result))
        return 0
    if args.warmup < 1:
        raise ValueError(f"--warmup={args.warmup}: skip at least the first step (engine start-up)")

    configs = ["quickstart"] if args.quick else ["quickstart", "o48"]
    if "o48" in configs and not (ROOT / O48_DATA).exists():
        print(f"generating {O48_DATA} (once) ...", flush=True)
        subprocess.run([str(PYTHON), "-m", "stormshard.data.synthetic", "--grid", "o48", "--steps", "400",
                        "--out", str(ROOT / O48_DATA)], cwd=ROOT, check=True,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    if not (ROOT / "data" / "synthetic.zarr").exists():
        print("generating data/synthetic.zarr (once) ...", flush=True)
        # the data `make train` makes (configs/quickstart.json's dates need its 600 steps)
        subprocess.run([str(PYTHON), "-m", "stormshard.data.synthetic", "--grid", "o16", "--steps", "600",
                        "--out", str(ROOT / "data" / "synthetic.zarr")],
                       cwd=ROOT, check=True, env=dict(os.environ, OMP_NUM_THREADS="1"))

    cases = [c for c in _cases(args.quick, configs) if args.only is None or args.only in c.name]
    runs = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench_training_") as tmp:
        if args.keep:
            tmp = str(Path(args.keep).resolve())
        for i, case in enumerate(cases, 1):
            print(f"[{i}/{len(cases)}] {case.name}: world {case.world}, gpus_per_model {case.gpus_per_model}, "
                  f"engine {case.engine}{'' if case.zero_stage is None else f' ZeRO {case.zero_stage}'}"
                  f"{', PowerSGD' if case.compression else ''}, {case.steps} steps", flush=True)
            r = _run_case(case, Path(tmp), args.warmup, args.launcher, args.timeout)
            if "error" not in r:
                print(f"    step {r['step_time_median_s']:.3f} s, {r['samples_per_s']:.2f} samples/s, peak RSS "
                      + "/".join(f"{m:.0f}" for m in r["peak_rss_mib_per_rank"]) + f" MiB ({r['wall_s']:.0f} s)",
                      flush=True)
            runs.append(r)

    import deepspeed
    import torch

    cores = os.cpu_count() or 1
    result = {
        "machine": {
            "cpu_count": cores, "platform": platform.platform(), "python": platform.python_version(),
            "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "note": f"shared {cores}-core CPU machine, OMP_NUM_THREADS=1 per process, gloo",
        },
        "settings": {"quick": args.quick, "launcher": args.launcher, "warmup_steps": args.warmup,
                     "memory": "per-rank getrusage(RUSAGE_SELF).ru_maxrss at exit (host RSS)",
                     "step_time": "rank 0 metrics.jsonl step_time, median after warm-up",
                     "efficiency": "E = T1 / TN, T = median step time, micro batch per replica fixed",
                     "total_wall_s": time.perf_counter() - start},
        "runs": runs,
        "scaling": _scaling(runs, configs),
        "compression": _compression(runs),
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").write_text(json.dumps(result, indent=1))
    plot(result, out / "training.png")
    print("\n" + report_tables(result))
    print(f"\nwrote {out / 'training.json'} and {out / 'training.png'} "
          f"({result['settings']['total_wall_s']:.0f} s; {result['machine']['note']})")
    return 0 if all("error" not in r for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
