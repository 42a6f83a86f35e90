"""Run an anemoi benchmark script with its dense matrix products timed and counted (run with anemoi's interpreter).

    python gemm_floor.py OUT_DIR SCRIPT [script args ...]      # or under torchrun, one per rank

runs ``SCRIPT`` as ``__main__`` inside :class:`DenseGemmTimer` (``benchmarks/gemm_timer.py``) and
writes ``OUT_DIR/rank<r>.json`` with the dense products' seconds, FLOPs and calls per step (totals
divided by the script's ``--warmup`` + ``--steps``; every step does the same work). The timed
run's wall times are not used (the timer's dispatch adds overhead): this run measures only the
work of the products, for ``bench_graph_vs_anemoi.py --compare --floor``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gemm_timer import DenseGemmTimer  # noqa: E402


def _arg(argv: list[str], name: str, default: int) -> int:
    return int(argv[argv.index(name) + 1]) if name in argv else default


def main() -> None:
    out_dir, script, *argv = sys.argv[1:]
    steps = _arg(argv, "--warmup", 1) + _arg(argv, "--steps", 3)
    rank = int(os.environ.get("RANK", 0))
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    with DenseGemmTimer() as timer:
        runpy.run_path(script, run_name="__main__")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(dict(rank=rank, gemm_s_per_step=timer.seconds / steps, gemm_flops_per_step=timer.flops / steps,
                       gemm_calls_per_step=timer.calls / steps), fh)


if __name__ == "__main__":
    main()
