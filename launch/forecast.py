"""Forecast from an exported bundle or a training checkpoint of any layout, in one process or
model-sharded over several (any --gpus-per-model K the grid allows, independent of the layout the
model trained at; world / K replicas share the initial dates and ensemble members).

    python launch/forecast.py --model bundles/quickstart --dataset data/synthetic.zarr \\
        --date 2020-05-10T00 --steps 8 --out forecasts/2020-05-10 --plot tracer_1 tracer_3
    torchrun --nproc_per_node 4 launch/forecast.py --model runs/quickstart/checkpoints \\
        --gpus-per-model 2 --dataset data/synthetic.zarr --date 2020-05-10T00 2020-05-11T00 \\
        --steps 8 --out forecasts/may --formats zarr netcdf
    DS_ACCELERATOR=cpu deepspeed --num_accelerators 2 launch/forecast.py --model ... --gpus-per-model 2 ...
    srun python launch/forecast.py --model ... --gpus-per-model 4 ...      # one task per GPU

Writes, per initial date (OUT itself for one date, OUT/<YYYYmmddTHHMM>/ for each of several):
forecast.zarr (anemoi layout, written in regions by every rank), forecast.nc (--formats netcdf;
needs the netcdf extra), scores.json (RMSE and anomaly correlation per lead time of the model,
persistence and the training-period climatology; CRPS and spread/skill for ensembles) and
maps/<variable>_step<k>.png; and OUT/plots/scores_<variable>.png (scores against lead time),
OUT/scores.json (several dates combined), OUT/climatology.npz.

A model whose stored config names its builder as ``package.module:attribute`` (a module that
importing would run) is refused before any work unless ``--trust-model-code`` is given. A failure
prints one message (``error: ...``) from rank 0 and exits with status 2 for bad input, 1 otherwise
(``stormshard.cli``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stormshard.cli import add_debug_flag, add_trust_flag, check_arguments_not_empty, run_cli  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="an exported bundle, a training checkpoint (step_NNNNNNNN or a run's "
                        "checkpoints directory, any layout) or a consolidated checkpoint")
    source.add_argument("--bundle", help="an exported inference bundle (same as --model)")
    parser.add_argument("--dataset", required=True, help="anemoi-layout dataset with the initial states and truth")
    parser.add_argument("--date", nargs="+", required=True, help="initial dates (the last input state), e.g. 2020-05-10T00")
    parser.add_argument("--steps", type=int, default=4, help="lead times to forecast (model timesteps)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--gpus-per-model", type=int, default=1, help="ranks that hold one model (K)")
    parser.add_argument("--members", type=int, default=None,
                        help="ensemble members per date (default: the ensemble size the model trained with)")
    parser.add_argument("--seed", type=int, default=0, help="noise seed of the ensemble members")
    parser.add_argument("--precision", default=None, choices=["fp32", "bf16", "fp16", "fp64"],
                        help="inference precision (default: the model's training precision)")
    parser.add_argument("--formats", nargs="+", default=["zarr"], help="zarr (always written) and netcdf")
    parser.add_argument("--cells-per-chunk", type=int, default=None,
                        help="grid cells per zarr chunk (default: the largest grid slice)")
    parser.add_argument("--plot", nargs="*", default=[], help="output variables to map")
    parser.add_argument("--plot-steps", nargs="*", type=int, default=None, help="lead steps to map (default: last)")
    parser.add_argument("--no-scores", action="store_true", help="skip the scores and their plots")
    parser.add_argument("--attention-kernel", default=None, choices=["auto", "banded", "flex", "flash"],
                        help="sliding-window kernel for this forecast (default: the model's own; flex runs its "
                             "forward on a CPU too)")
    parser.add_argument("--graph-kernel", default=None, choices=["auto", "csr", "triton"],
                        help="graph-transformer attention kernel for this forecast (default: the model's own; a model "
                             "trained with 'triton' forecasts on a CPU with 'auto' or 'csr')")
    parser.add_argument("--graph", default=None, help="the graph file (checkpoints only; default: found or rebuilt)")
    parser.add_argument("--weights", default=None, choices=["averaged", "trained"],
                        help="a checkpoint's weights: its training.weight_averaging average (the default where it has "
                             "one) or the trained ones")
    parser.add_argument("--overwrite", action="store_true")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the DeepSpeed launcher")
    add_trust_flag(parser)
    add_debug_flag(parser)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))

    def body() -> None:
        check_arguments_not_empty(argv)  # an empty --out would mean the current directory
        import torch
        import torch.distributed as dist

        # a checkpoint's DeepSpeed optimizer state imports DeepSpeed (for its plain-data classes); on a
        # machine without CUDA its accelerator detection would print "If you have GPU ..." on every run
        os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")

        from stormshard.inference.forecast import run_forecast
        from stormshard.training.launch import detect_launch, init_distributed

        owns_group = not dist.is_initialized() and detect_launch().world_size > 1
        if owns_group:
            init_distributed()
        try:
            run_forecast(args.model or args.bundle, args.dataset, args.date, args.steps, args.out,
                         gpus_per_model=args.gpus_per_model, members=args.members, seed=args.seed,
                         precision=args.precision, formats=args.formats, plot_variables=args.plot,
                         plot_steps=args.plot_steps, verify=not args.no_scores,
                         cells_per_chunk=args.cells_per_chunk, graph=args.graph, overwrite=args.overwrite,
                         attention_kernel=args.attention_kernel, graph_kernel=args.graph_kernel,
                         trust_model_code=args.trust_model_code, weights=args.weights,
                         verbose=(dist.get_rank() if dist.is_initialized() else 0) == 0)
        finally:
            if owns_group:
                dist.destroy_process_group()

    return run_cli(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
