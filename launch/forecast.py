"""Forecast from an inference bundle (see launch/convert_checkpoint.py export).

    python launch/forecast.py --bundle bundles/quickstart --dataset data/synthetic.zarr \\
        --date 2020-05-10T00 --steps 8 --out forecasts/2020-05-10 --plot tracer_1 tracer_3

Writes OUT/forecast.zarr (anemoi layout), OUT/rmse.json (RMSE per lead time, model and
persistence) and OUT/maps/<variable>_step<k>.png (forecast, truth, error).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stormshard.checkpoint.errors import ConversionError  # noqa: E402
from stormshard.inference.forecast import run_forecast  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", required=True, help="an exported inference bundle")
    parser.add_argument("--dataset", required=True, help="anemoi-layout dataset with the initial states and truth")
    parser.add_argument("--date", required=True, help="date of the last input state, e.g. 2020-05-10T00")
    parser.add_argument("--steps", type=int, default=4, help="lead times to forecast (model timesteps)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--plot", nargs="*", default=[], help="output variables to map")
    parser.add_argument("--plot-steps", nargs="*", type=int, default=None, help="lead steps to map (default: last)")
    parser.add_argument("--members", type=int, default=1, help="ensemble members (ensemble models only)")
    parser.add_argument("--seed", type=int, default=0, help="noise seed of the ensemble members")
    parser.add_argument("--overwrite", action="store_true")
    args = parser.parse_args(argv)
    try:
        run_forecast(args.bundle, args.dataset, args.date, args.steps, args.out, plot_variables=args.plot,
                     plot_steps=args.plot_steps, members=args.members, seed=args.seed, overwrite=args.overwrite)
    except (ConversionError, ValueError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
