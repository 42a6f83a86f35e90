"""Train a model from a JSON experiment config.

    DS_ACCELERATOR=cpu deepspeed --num_accelerators 2 launch/train.py --config configs/quickstart.json
    deepspeed launch/train.py --config configs/aifs_n320_o96.json         # GPUs (NCCL)
    torchrun --nproc_per_node 2 launch/train.py --config configs/quickstart.json
    python launch/train.py --config configs/quickstart.json training.max_steps=50 parallel.gpus_per_model=1
    srun python launch/train.py --config configs/aifs_n320_o96.json       # SLURM, one task per GPU
    mpirun -n 2 python launch/train.py --config configs/quickstart.json   # OpenMPI / MPICH

Positional ``dotted.key=value`` items after the options override the config (hydra / anemoi
style): a value is JSON when it parses (``50``, ``1e-4``, ``true``, ``[0.9, 0.95]``) and a string
otherwise; an unknown key is an error with a did-you-mean (``stormshard.training.config_file``). The
resolved config is saved as ``<training.output_dir>/config.json``.

Options: ``--resume`` continues from the newest checkpoint in ``training.output_dir`` (an error,
raised before anything starts, when that directory holds none);
``--trust-model-code``: a ``--config`` that came with a bundle or checkpoint (a stormshard
``metadata.json`` beside it, e.g. a bundle's ``finetune_config.json``) may name its model builder as
``package.module:attribute`` (without the flag that is an error, and nothing is imported; a builder
named by your own config needs no flag); ``--deepspeed_config FILE`` (a DeepSpeed JSON config) replaces the config's ``deepspeed`` section;
its ``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``, ``gradient_clipping`` and
``optimizer`` (AdamW) move to ``training.micro_batch_size``, ``training.gradient_accumulation_steps``,
``training.gradient_clipping`` and the ``optimizer`` section, and a value the config sets differently
is an error (``stormshard.training.config.merge_deepspeed_file``); ``--local_rank`` is accepted
from DeepSpeed's launcher; ``--debug`` prints the traceback of a failure. Multi-node: DeepSpeed's own
launcher (``--hostfile``, ``--launcher slurm|openmpi|mpich``), torchrun, or ``srun`` / ``mpirun``
with one process per GPU (``stormshard.training.launch.detect_launch`` maps their variables); see
the README.

A failure prints one message (``error: ...``) from rank 0 and exits with status 2 for bad input
(config, flags, data, checkpoints), 1 otherwise (``stormshard.cli``).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stormshard.cli import add_debug_flag, add_trust_flag, check_arguments_not_empty, run_cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="experiment config (JSON)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="config overrides, e.g. training.max_steps=50 training.lr=1e-4 (values are JSON or strings)")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the latest checkpoint in training.output_dir (error if there is none)")
    parser.add_argument("--deepspeed_config", default=None, help="DeepSpeed JSON config replacing the deepspeed section (its batch, clipping and "
                        "optimizer keys move to the engine-neutral fields)")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help="set by the DeepSpeed launcher")
    add_trust_flag(parser, "import the model builder module (model.name 'package.module:attribute') that a --config "
                           "which came with a bundle or checkpoint (a stormshard metadata.json beside it) names")
    add_debug_flag(parser)
    args = parser.parse_intermixed_args(argv)  # overrides may stand before or after the options
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))

    def body() -> None:
        check_arguments_not_empty(argv)  # an empty --config / --deepspeed_config value names the option
        # the config is read and validated before torch or DeepSpeed is imported: a bad one fails in a
        # fraction of a second (stormshard.training.config imports neither)
        from stormshard.training.config import load_experiment_config

        config = load_experiment_config(args.config, deepspeed_config=args.deepspeed_config,
                                        cli_overrides=args.overrides)
        from stormshard.models.trust import check_model_code, stored_beside

        # a bundle's finetune_config.json, a run's config.json, a folder that ships its builder: a stored file
        stored = stored_beside(args.config, config.model.name)
        if stored is not None:
            check_model_code(config.model.name, f"--config {args.config} (beside {stored})",
                             args.trust_model_code)
        from stormshard.training.launch import run_training

        run_training(config, resume=args.resume)

    return run_cli(body, debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
