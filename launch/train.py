"""Train a model from a JSON experiment config.

    DS_ACCELERATOR=cpu deepspeed --num_accelerators 2 launch/train.py --config configs/quickstart.json
    deepspeed launch/train.py --config configs/aifs_o96.json              # GPUs (NCCL)
    torchrun --nproc_per_node 2 launch/train.py --config configs/quickstart.json
    python launch/train.py --config configs/quickstart.json               # one process

Options: ``--resume`` continues from the newest checkpoint in ``training.output_dir``;
``--deepspeed_config FILE`` replaces the config's ``deepspeed`` section; ``--local_rank`` is
accepted from DeepSpeed's launcher. Multi-node: DeepSpeed's own launcher (``--hostfile``) or SLURM
(``srun`` with torchrun); see the README.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stormshard.training.launch import run_training  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="experiment config (JSON)")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    parser.add_argument("--deepspeed_config", default=None, help="JSON file replacing the deepspeed section")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the DeepSpeed launcher")
    args = parser.parse_args(argv)
    overrides = {}
    if args.deepspeed_config:
        overrides["deepspeed"] = json.loads(Path(args.deepspeed_config).read_text())
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))
    run_training(args.config, resume=args.resume, overrides=overrides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
