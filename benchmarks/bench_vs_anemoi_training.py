"""The whole training step against anemoi-training 0.17.1, same data and matched models, with the defaults.

Drives the side-by-side harness ``../shared/anemoi-training/`` (its README says what "matched" means):
per round, ``bench.sh VARIANT SIZE PROCS STEPS 1`` runs anemoi-training and stormshard with its default
settings (engine ``ddp``, as anemoi uses; ``BUCKETED=1`` adds the ``"bucketed"`` row), then this script
runs stormshard once more per process count with ``engine: "deepspeed"`` at ZeRO 1 (the engine the
configs in ``configs/`` use: ``run_stormshard.sh`` with ``SS_SET``), so that every row of a round sees the
same background load. Rounds go to ``OUT/r<k>/``; the harness's ``tools/summarize.py`` merges them and
this script prints one table: steps/s and their ratio to anemoi's, peak PSS per rank and its ratio, with
the machine (CPU model, cores) and the 1-min load before the runs.

    python benchmarks/bench_vs_anemoi_training.py --quick      # gt o16, 1 and 2 processes, 1 round, short runs
    python benchmarks/bench_vs_anemoi_training.py              # gt and transformer, o16 and o48, 1 and 2, 2 rounds
    python benchmarks/bench_vs_anemoi_training.py --variants gt --sizes o48 --procs 2 --rounds 3 --steps 25
    python benchmarks/bench_vs_anemoi_training.py --markdown out.md   # also write the table there

Needs the anemoi-training venv (``$ANEMOI_TRAINING_ENV``, default ``/root/anemoi-training-env``, then
``~/anemoi-training-env``); without it this prints how to build one (``../shared/anemoi-training/setup.sh``)
and exits 0. The harness lives in ``$ANEMOI_TRAINING_HARNESS`` (default ``../shared/anemoi-training``
next to the checkout). Only ratios from one run mean anything: absolute times move up to 2x between
hours on shared machines.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {
    "zero1": {"engine": "deepspeed", "deepspeed": {"zero_optimization": {"stage": 1}}},
}
LABELS = {"anemoi": "anemoi", "stormshard": "stormshard, engine ddp",
          "stormshard-bucketed": "stormshard ddp, `bucketed` (old mode)", "stormshard-zero1": "stormshard, deepspeed ZeRO 1"}
ORDER = ["anemoi", "stormshard", "stormshard-zero1", "stormshard-bucketed"]


def find_env() -> Path | None:
    """The anemoi-training venv: $ANEMOI_TRAINING_ENV, /root/anemoi-training-env or ~/anemoi-training-env."""
    candidates = [os.environ.get("ANEMOI_TRAINING_ENV"), "/root/anemoi-training-env",
                  str(Path.home() / "anemoi-training-env")]
    for c in candidates:
        if c and (Path(c) / "bin" / "python").exists():
            return Path(c)
    return None


def find_harness() -> Path:
    return Path(os.environ.get("ANEMOI_TRAINING_HARNESS", ROOT.parent / "shared" / "anemoi-training")).resolve()


def machine() -> str:
    """CPU model and core count, from /proc/cpuinfo where it exists."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    flags = ""
    try:
        text = Path("/proc/cpuinfo").read_text()
        flags = "AVX-512" if "avx512f" in text else ("AVX2" if "avx2" in text else "")
    except OSError:
        pass
    return f"{model}{', ' + flags if flags else ''}, {os.cpu_count()} cores"


def load1() -> float | None:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except (OSError, ValueError):
        return None


def run(cmd: list[str], env: dict[str, str], log: Path) -> int:
    with open(log, "a") as f:
        return subprocess.run(cmd, env=env, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, check=False).returncode


def one_round(args: argparse.Namespace, harness: Path, env: dict[str, str], out: Path, log: Path) -> None:
    """One round: per variant and size, bench.sh (anemoi + stormshard defaults), then the extra engines."""
    for variant in args.variants:
        for size in args.sizes:
            steps = args.steps or (25 if size == "o48" else 45)
            procs = " ".join(str(p) for p in args.procs)
            e = {**env, "OUT": str(out), "BUCKETED": "1" if args.bucketed else "0", "PROCS": procs}
            print(f"  {variant} {size}: bench.sh, processes {procs}, {steps} steps (load {load1()})", flush=True)
            rc = run([str(harness / "bench.sh"), variant, size, "both" if len(args.procs) > 1 else procs,
                      str(steps), "1"], e, log)
            if rc:
                print(f"    bench.sh exited {rc}: see {log}", flush=True)
            for name in args.engines:
                for np_ in args.procs:
                    run_dir = out / "bench" / f"{variant}_{size}" / f"stormshard-{name}_np{np_}_rep1"
                    e2 = {**e, "RUN_DIR": str(run_dir), "STEPS": str(steps), "SS_SET": json.dumps(ENGINES[name])}
                    before = load1()
                    rc = run([str(harness / "run_stormshard.sh"), variant, size, str(np_)], e2, log)
                    if run_dir.is_dir():
                        (run_dir / "load_before.txt").write_text(f"{before}\n")
                    print(f"    stormshard {name}, {np_} process(es): rc={rc} (load {before})", flush=True)


def summarize(harness: Path, env_python: Path, rounds: list[Path]) -> list[dict]:
    dirs = [str(r / "bench") for r in rounds if (r / "bench").is_dir()]
    if not dirs:
        return []
    res = subprocess.run([str(env_python), str(harness / "tools" / "summarize.py"), "--json", *dirs],
                         capture_output=True, text=True, check=False)
    if res.stderr.strip():
        print(res.stderr.strip(), file=sys.stderr)
    return [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]


def merge_runs(harness: Path, env_dir: Path, bases: list[Path], out: str | None) -> int:
    """One table over every round under ``bases`` (directories an earlier run wrote: ``<stamp>/r<k>``)."""
    missing = [str(b) for b in bases if not b.is_dir()]
    if missing:
        print(f"--merge: no such directory: {', '.join(missing)} (give the OUT/<stamp> directories of earlier runs)",
              file=sys.stderr)
        return 2
    rounds = sorted(r for b in bases for r in b.glob("r*") if (r / "bench").is_dir())
    rows = summarize(harness, env_dir / "bin" / "python", rounds)
    if not rows:
        print(f"--merge: no complete runs under {', '.join(map(str, bases))}", file=sys.stderr)
        return 1
    note = (f"Machine: {machine()}; gloo, OMP_NUM_THREADS=1; {len(rounds)} round(s) of {len(bases)} run(s) merged. "
            "Per run the median step (first 5 untimed), per row the median over runs (min-max). "
            "speed vs anemoi: steps/s ratio (> 1: stormshard faster); PSS vs anemoi < 1: stormshard smaller.")
    table = markdown(rows)
    print(table)
    print()
    print(note)
    if out:
        Path(out).write_text(table + "\n\n" + note + "\n")
    return 0


def markdown(rows: list[dict]) -> str:
    order = {lib: i for i, lib in enumerate(ORDER)}
    rows = sorted(rows, key=lambda r: (r["bench"], r["processes"], order.get(r["library"], 9)))
    f = lambda x, fmt: "-" if x is None else format(x, fmt)  # noqa: E731
    lines = ["| variant, size | processes | library | runs | step s (min-max) | steps/s | speed vs anemoi "
             "| peak PSS per rank MiB | PSS vs anemoi |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['bench'].replace('_', ' ')} | {r['processes']} | {LABELS.get(r['library'], r['library'])} "
            f"| {r['runs']} | {r['step_s']:.3f} ({r['step_min_s']:.3f}-{r['step_max_s']:.3f}) "
            f"| {r['steps_per_s']:.2f} | {f(r['speed_vs_anemoi'], '.2f')}x | {r['rank_pss_mib']:.0f} "
            f"| {f(r['pss_vs_anemoi'], '.2f')}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="gt o16, 1 and 2 processes, 1 round of 15 steps")
    p.add_argument("--variants", default="gt,transformer")
    p.add_argument("--sizes", default="o16,o48")
    p.add_argument("--procs", default="1,2")
    p.add_argument("--engines", default="zero1", help="extra stormshard engines: zero1 (deepspeed ZeRO 1), or none")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=0, help="steps per run (default 45 at o16, 25 at o48; 5 untimed)")
    p.add_argument("--bucketed", action="store_true", help="also the old 'bucketed' reduction at 2 processes")
    p.add_argument("--out", default=str(ROOT / ".cache" / "anemoi-training-bench" / "vs_anemoi"))
    p.add_argument("--markdown", default=None, help="write the table (and the machine line) to this file")
    p.add_argument("--merge", nargs="+", default=None, metavar="DIR",
                   help="run nothing: one table over the rounds of earlier runs (their OUT/<stamp> directories)")
    args = p.parse_args(argv)
    if args.quick:
        args.variants, args.sizes, args.procs, args.rounds, args.steps = "gt", "o16", "1,2", 1, args.steps or 15
    args.variants, args.sizes = args.variants.split(","), args.sizes.split(",")
    args.procs = [int(x) for x in args.procs.split(",")]
    args.engines = [] if args.engines in ("", "none") else args.engines.split(",")
    unknown = [e for e in args.engines if e not in ENGINES]
    if unknown:
        p.error(f"--engines {unknown} unknown: choose from {sorted(ENGINES)} or none")

    harness, env_dir = find_harness(), find_env()
    if env_dir is None or not (harness / "bench.sh").exists():
        where = harness if (harness / "bench.sh").exists() else "../shared/anemoi-training"
        print("bench_vs_anemoi_training: skipped, no anemoi-training venv"
              f"{'' if env_dir else ' (ANEMOI_TRAINING_ENV, /root/anemoi-training-env, ~/anemoi-training-env)'}"
              f"{'' if (harness / 'bench.sh').exists() else f' and no harness at {harness}'}.\n"
              f"Build it (about 2 min, torch 2.13 CPU + anemoi-training 0.17.1 in its own venv):\n"
              f"    {where}/setup.sh                 # or ANEMOI_TRAINING_ENV=/path {where}/setup.sh\n"
              "then run this script again (ANEMOI_TRAINING_HARNESS points at another harness copy).")
        return 0
    if args.merge:
        return merge_runs(harness, env_dir, [Path(d) for d in args.merge], args.markdown)
    env = {**os.environ, "ANEMOI_TRAINING_ENV": str(env_dir), "STORMSHARD": str(ROOT),
           "DATA_DIR": os.environ.get("DATA_DIR", str(ROOT / ".cache" / "anemoi-training-bench" / "data")),
           "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    stamp = time.strftime("%Y%m%d-%H%M%S")
    base = Path(args.out) / stamp
    base.mkdir(parents=True, exist_ok=True)
    log = base / "bench.log"
    print(f"anemoi-training vs stormshard: {','.join(args.variants)} x {','.join(args.sizes)}, processes "
          f"{args.procs}, engines ddp + {args.engines or 'none'}, {args.rounds} round(s) -> {base}", flush=True)
    rounds = []
    loads = [load1()]
    t0 = time.time()
    for k in range(1, args.rounds + 1):
        print(f"round {k}/{args.rounds}", flush=True)
        out = base / f"r{k}"
        rounds.append(out)
        one_round(args, harness, env, out, log)
        loads.append(load1())
    rows = summarize(harness, env_dir / "bin" / "python", rounds)
    if not rows:
        print(f"no complete runs: see {log}", file=sys.stderr)
        return 1
    seen = [x for x in loads if x is not None]
    note = (f"Machine: {machine()}; gloo, OMP_NUM_THREADS=1; {args.rounds} round(s), "
            f"{time.time() - t0:.0f} s; 1-min load {min(seen):.1f}-{max(seen):.1f} between rounds. "
            "Per run the median step (first 5 untimed), per row the median over runs (min-max). "
            "speed vs anemoi: steps/s ratio (> 1: stormshard faster); PSS vs anemoi < 1: stormshard smaller. "
            "stormshard rows use its defaults (model_parallel_grad_reduction 'auto') unless noted.")
    table = markdown(rows)
    print(table)
    print(note)
    if args.markdown:
        Path(args.markdown).write_text(table + "\n\n" + note + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
