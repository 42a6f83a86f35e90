"""One rank of a forecast benchmark case (started by benchmarks/bench_forecast.py under torchrun):
run_forecast without scores, then this rank's timings and peak memory as JSON."""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--dataset", required=True)
    p.add_argument("--dates", nargs="+", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--gpus-per-model", type=int, required=True)
    p.add_argument("--precision", default="fp32")
    p.add_argument("--out", required=True)
    p.add_argument("--result", required=True)
    a = p.parse_args()
    import torch
    import torch.distributed as dist

    from stormshard.inference.forecast import run_forecast
    from stormshard.training.launch import detect_launch, init_distributed

    if detect_launch().world_size > 1:
        init_distributed()
    rank = dist.get_rank() if dist.is_initialized() else 0
    r = run_forecast(a.model, a.dataset, a.dates, a.steps, a.out, gpus_per_model=a.gpus_per_model,
                     precision=a.precision, verify=False, verbose=False, overwrite=True)
    row = {"rank": rank, **r.timings, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if torch.cuda.is_available():
        row["cuda_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    Path(f"{a.result}.rank{rank}").write_text(json.dumps(row))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
