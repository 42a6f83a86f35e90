"""Convert training checkpoints: consolidate, reshard, export, inspect, upgrade.

    python launch/convert_checkpoint.py inspect runs/quickstart/checkpoints [--json] [--verify]
    python launch/convert_checkpoint.py consolidate runs/quickstart/checkpoints --out runs/quickstart/full
    python launch/convert_checkpoint.py reshard runs/quickstart/checkpoints --gpus-per-model 4 \\
        [--shard-strategy tensor] [--world-size N] --out runs/k4/checkpoints
    python launch/convert_checkpoint.py export runs/quickstart/checkpoints --out bundles/quickstart
    python launch/convert_checkpoint.py upgrade runs/old/checkpoints   # pickled format 1 -> current, in place
    python launch/convert_checkpoint.py import-anemoi inference-last.ckpt --out bundles/aifs  # no anemoi needed
    python launch/convert_checkpoint.py import-anemoi last.ckpt --out bundles/aifs  # Lightning, older layouts too
    python launch/convert_checkpoint.py export-anemoi bundles/aifs --out aifs-finetuned.ckpt  # for anemoi-inference
    python launch/convert_checkpoint.py export-anemoi runs/quickstart/checkpoints --out quickstart.ckpt  # + anemoi-models

A CHECKPOINT is a step_NNNNNNNN directory, a run's checkpoints directory (its latest checkpoint)
or a consolidated checkpoint. Nothing is written when conversion fails; the error lists every
difference found (one message, exit status 2; ``--debug`` adds the traceback). Nothing a file names
runs: a stored config whose model builder is ``package.module:attribute`` (a module that importing
would run) is an error for ``export`` and ``reshard`` unless ``--trust-model-code`` is given, and
``upgrade`` unpickles format-1 files with an allow-list (tensors, numpy arrays and scalars,
DeepSpeed's plain-data classes), anything else only with ``--trust-model-code``. After ``reshard``, resume with ``OUT/resume_config.json``:

    deepspeed --num_accelerators 4 launch/train.py --config runs/k4/checkpoints/resume_config.json --resume
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from stormshard.checkpoint.anemoi_export import export_anemoi  # noqa: E402
from stormshard.checkpoint.anemoi_import import import_anemoi  # noqa: E402
from stormshard.checkpoint.averaged_weights import WEIGHT_CHOICES, choose_weights  # noqa: E402
from stormshard.checkpoint.consolidate import (  # noqa: E402
    check_output_free,
    check_output_path,
    consolidate_checkpoint,
    save_consolidated,
)
from stormshard.checkpoint.errors import ConversionError  # noqa: E402
from stormshard.checkpoint.export import export_bundle  # noqa: E402
from stormshard.checkpoint.inspect import format_inspection, inspect_checkpoint, verify_checkpoint  # noqa: E402
from stormshard.checkpoint.reshard import reshard_checkpoint  # noqa: E402
from stormshard.checkpoint.upgrade import upgrade_checkpoints  # noqa: E402
from stormshard.cli import add_debug_flag, add_trust_flag, check_arguments_not_empty, run_cli  # noqa: E402
from stormshard.errors import check_writable_directory, no_partial_output  # noqa: E402
from stormshard.parallel.shard import SHARD_STRATEGIES  # noqa: E402
from stormshard.progress import reporting  # noqa: E402


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect", help="layout, step, parameter names, shapes and sizes")
    p.add_argument("checkpoint")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--brief", action="store_true", help="leave out the parameter table")
    p.add_argument("--verify", action="store_true", help="also check every file against the size and sha256 recorded "
                   "when it was written (a copy's integrity); a damaged file is an error naming it")
    p = sub.add_parser("consolidate", help="one full-model checkpoint (safetensors + optimizer state)")
    p.add_argument("checkpoint")
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--weights", choices=WEIGHT_CHOICES, default=None,
                   help="keep the training.weight_averaging average beside the trained weights (the default; "
                        "'averaged' also requires one) or leave it out ('trained': what reads the result then takes "
                        "the trained weights)")
    p = sub.add_parser("reshard", help="a training checkpoint for another gpus_per_model / shard strategy")
    p.add_argument("checkpoint")
    p.add_argument("--out", required=True, help="a checkpoints directory (e.g. runs/NEW/checkpoints)")
    p.add_argument("--gpus-per-model", type=int, required=True)
    p.add_argument("--shard-strategy", choices=SHARD_STRATEGIES, default=None)
    p.add_argument("--world-size", type=int, default=None, help="default: gpus-per-model x the source's replicas")
    p.add_argument("--dataset", default=None, help="the training dataset, if data.path has moved")
    p.add_argument("--graph", default=None, help="the training graph file (default: found next to the run)")
    p.add_argument("--overwrite", action="store_true")
    add_trust_flag(p)
    p = sub.add_parser("export", help="an inference bundle for stormshard.load_model")
    p.add_argument("checkpoint")
    p.add_argument("--out", required=True)
    p.add_argument("--weights", choices=WEIGHT_CHOICES, default=None,
                   help="the checkpoint's training.weight_averaging average (the default where it has one) or the "
                        "trained weights")
    p.add_argument("--dataset", default=None)
    p.add_argument("--graph", default=None)
    p.add_argument("--overwrite", action="store_true")
    add_trust_flag(p)
    p = sub.add_parser("upgrade", help="rewrite checkpoints of the pickled format 1 in the current format, in place "
                                       "(the pickles are read with an allow-list: tensors, numpy, DeepSpeed's "
                                       "plain-data classes)")
    p.add_argument("checkpoint", help="a run's checkpoints directory (every step in it), a step_NNNNNNNN "
                                      "directory or a consolidated checkpoint")
    add_trust_flag(p, "also unpickle what the allow-list refuses (any other class or function the file names)")
    p = sub.add_parser("import-anemoi", help="an inference bundle from an anemoi checkpoint (read without "
                                             "anemoi and without running anything in the file)")
    p.add_argument("checkpoint", help="an anemoi-training inference-*.ckpt or Lightning last.ckpt (anemoi-models "
                                      "0.19, or an older layout anemoi's migration rules map)")
    p.add_argument("--out", required=True)
    p.add_argument("--overwrite", action="store_true")
    p = sub.add_parser("export-anemoi", help="an anemoi inference checkpoint (for anemoi-inference) from a bundle "
                                             "or training checkpoint")
    p.add_argument("checkpoint", help="a bundle (made by export or import-anemoi) or a training checkpoint of a "
                                      "graphtransformer or transformer model; one not imported from an anemoi "
                                      "inference checkpoint needs anemoi-models importable")
    p.add_argument("--out", required=True, help="the .ckpt file to write")
    p.add_argument("--dataset", default=None, help="a training checkpoint's dataset, if data.path has moved")
    p.add_argument("--graph", default=None, help="a training checkpoint's graph file (default: found next to the run)")
    p.add_argument("--overwrite", action="store_true")
    for sp in sub.choices.values():
        add_debug_flag(sp)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Conversion runs on the CPU. Reading DeepSpeed's optimizer state imports DeepSpeed (for its plain-data
    # classes), whose accelerator detection would print "Setting accelerator to CPU. If you have GPU ..."
    # on every convert; naming its (unused) accelerator up front keeps it quiet.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

    def body() -> None:
        check_arguments_not_empty(argv)  # an empty --out would mean the current directory
        out = getattr(args, "out", None)  # a failure leaves none of it behind (a full disk is named with it)
        # reshard may write into an existing --out: what it adds there goes too (its step, latest.part)
        reshard_files = ("latest", "latest.part", "resume_config.json", "resume_config.json.part")
        written = reshard_files if args.command == "reshard" else ()
        with reporting(), no_partial_output(out, written) if out else contextlib.nullcontext():
            _run(args)  # standard error: a line per phase; standard output keeps the results (--json)

    return run_cli(body, debug=args.debug)


def _run(args: argparse.Namespace) -> None:
    """The subcommand; failures are reported by ``stormshard.cli.run_cli``."""
    if args.command not in ("inspect", "upgrade"):  # upgrade rewrites in place: no --out
        check_writable_directory(Path(args.out).parent, "--out", args.out)  # before anything is read
    if args.command == "inspect":
        info = inspect_checkpoint(args.checkpoint)
        if args.verify:  # before anything is printed: a damaged checkpoint is the one error line
            info["verified"] = verify_checkpoint(args.checkpoint)
        print(json.dumps(info, indent=1) if args.json else format_inspection(info, parameters=not args.brief))
    elif args.command == "upgrade":
        for path, what in upgrade_checkpoints(args.checkpoint, trust_pickles=args.trust_model_code):
            print(f"{path}: {what}")
    elif args.command == "consolidate":
        check_output_path(args.checkpoint, args.out, args.overwrite)
        check_output_free(args.out, args.overwrite)  # before the checkpoint is read
        ckpt = consolidate_checkpoint(args.checkpoint)
        if args.weights is not None:  # 'averaged' on a checkpoint without an average is an error
            choose_weights(ckpt.model, ckpt.average, args.weights, str(args.checkpoint))
        if args.weights == "trained":
            ckpt.average, ckpt.average_info = None, {}
        out = save_consolidated(ckpt, args.out, overwrite=args.overwrite)
        print(f"consolidated step {ckpt.step} ({len(ckpt.model)} tensors) into {out}"
              + (f"\nnote: {ckpt.optimizer_note}" if ckpt.optimizer_note else ""))
    elif args.command == "reshard":
        out = reshard_checkpoint(args.checkpoint, args.out, args.gpus_per_model, args.shard_strategy,
                                 world_size=args.world_size, dataset=args.dataset, graph=args.graph,
                                 overwrite=args.overwrite, trust_model_code=args.trust_model_code)
        print(f"wrote {out}\nresume with: launch/train.py --config {Path(args.out) / 'resume_config.json'} --resume")
    elif args.command == "export-anemoi":
        check_output_path(args.checkpoint, args.out, args.overwrite)
        if Path(args.out).is_dir():  # os.replace of the file onto it would fail only after the whole export
            raise ConversionError(f"--out {args.out} is a directory: export-anemoi writes one anemoi checkpoint file",
                                  fix=f"name a file for --out (e.g. {Path(args.out) / 'model.ckpt'})")
        out = export_anemoi(args.checkpoint, args.out, overwrite=args.overwrite, dataset=args.dataset,
                            graph=args.graph)
        print(f"exported {args.checkpoint} to {out}: load it with anemoi-inference (or torch.load(weights_only=False))")
    elif args.command == "import-anemoi":
        check_output_path(args.checkpoint, args.out, args.overwrite)
        out = import_anemoi(args.checkpoint, args.out, overwrite=args.overwrite)
        print(f"imported {args.checkpoint} into {out}: load it with stormshard.load_model({str(out)!r}); "
              f"fine-tune it with launch/train.py --config {out / 'finetune_config.json'} data.path=DATASET")
    else:
        out = export_bundle(args.checkpoint, args.out, dataset=args.dataset, graph=args.graph,
                            overwrite=args.overwrite, trust_model_code=args.trust_model_code, weights=args.weights)
        trust = ", trust_model_code=True" if args.trust_model_code else ""
        print(f"exported {out}: load it with stormshard.checkpoint.export.load_model({str(out)!r}{trust})")


if __name__ == "__main__":
    sys.exit(main())
