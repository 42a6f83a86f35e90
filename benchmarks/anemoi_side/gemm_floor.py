"""Run an anemoi benchmark script with its dense matrix products timed and counted (run with anemoi's interpreter).

    python gemm_floor.py OUT_DIR SCRIPT [script args ...]      # or under torchrun, one per rank

runs ``SCRIPT`` as ``__main__`` with the anemoi-bench step loop (``common.timed_steps``, found on
``$ANEMOI_BENCH``) patched so that every step runs inside its own :class:`DenseGemmTimer`
(``benchmarks/gemm_timer.py``), and writes ``OUT_DIR/rank<r>.json`` with the dense products'
seconds, FLOPs and calls of the last step (the first steps under the timer warm it up; every step
does the same work). The run's own wall times are not used (the timer's dispatch adds overhead):
this run measures only the work of the products, for ``bench_graph_vs_anemoi.py --compare --floor``.
"""

from __future__ import annotations

import json
import os
import runpy
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gemm_timer import DenseGemmTimer  # noqa: E402


def main() -> None:
    out_dir, script, *argv = sys.argv[1:]
    rank = int(os.environ.get("RANK", 0))
    sys.path.insert(0, os.environ.get("ANEMOI_BENCH", os.path.dirname(os.path.abspath(script))))
    import common  # anemoi-bench's helpers: the scripts import timed_steps from it

    steps: list[DenseGemmTimer] = []
    timed_steps = common.timed_steps

    def timed_steps_with_products(step_fn, warmup, count, group=None):  # noqa: ANN001, ANN202
        def step():  # noqa: ANN202
            with DenseGemmTimer() as timer:
                out = step_fn()
            steps.append(timer)
            return out

        return timed_steps(step, warmup, count, group)

    common.timed_steps = timed_steps_with_products
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    if not steps:
        raise RuntimeError(f"{script} ran no step through common.timed_steps: nothing was measured")
    last = steps[-1]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(dict(rank=rank, steps=len(steps), gemm_s_per_step=last.seconds, gemm_flops_per_step=last.flops,
                       gemm_calls_per_step=last.calls), fh)


if __name__ == "__main__":
    main()
