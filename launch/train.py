"""Train a model from a JSON experiment config.

    DS_ACCELERATOR=cpu deepspeed --num_accelerators 2 launch/train.py --config configs/quickstart.json
    deepspeed launch/train.py --config configs/aifs_o96.json              # GPUs (NCCL)
    torchrun --nproc_per_node 2 launch/train.py --config configs/quickstart.json
    python launch/train.py --config configs/quickstart.json               # one process

Options: ``--resume`` continues from the newest checkpoint in ``training.output_dir`` (an error,
raised before anything starts, when that directory holds none);
``--deepspeed_config FILE`` (a DeepSpeed JSON config) replaces the config's ``deepspeed`` section;
its ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``gradient_clipping`` and
``optimizer`` (AdamW) move to ``training.micro_batch_size``, ``training.gradient_accumulation_steps``,
``training.gradient_clipping`` and the ``optimizer`` section, and a value the config sets differently
is an error (``stormshard.training.config.merge_deepspeed_file``); ``--local_rank`` is accepted
from DeepSpeed's launcher. Multi-node: DeepSpeed's own launcher (``--hostfile``) or SLURM
(``srun`` with torchrun); see the README.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stormshard.training.config import ConfigError, load_experiment_config  # noqa: E402
from stormshard.training.launch import run_training  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="experiment config (JSON)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in training.output_dir (error if there is none)")
    parser.add_argument("--deepspeed_config", default=None, help="DeepSpeed JSON config replacing the deepspeed section (its batch, clipping and "
                        "optimizer keys move to the engine-neutral fields)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the DeepSpeed launcher")
    args = parser.parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    try:
        config = load_experiment_config(args.config, deepspeed_config=args.deepspeed_config)
        run_training(config, resume=args.resume)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
