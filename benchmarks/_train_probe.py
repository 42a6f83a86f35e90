"""Per-rank entry point of ``bench_training.py``: trains one config like ``launch/train.py`` and
writes what this rank saw to ``<report_dir>/rank<r>.json``.

Started by the DeepSpeed launcher or torchrun (one process per rank), never imported by the
library. It builds the run with the library's own steps (``load_experiment_config`` ->
``preflight`` -> ``init_distributed`` -> ``Trainer.fit``) and adds, from the outside:

- peak memory: this process's ``getrusage(RUSAGE_SELF).ru_maxrss`` at exit (host RSS; on GPUs
  also ``torch.cuda.max_memory_allocated``);
- communication: a :class:`CommCounter` open over the training steps after the warm-up (every
  stormshard collective: model-parallel traffic and the PowerSGD factor all-reduces; DeepSpeed's
  and DDP's own gradient all-reduces do not pass through it);
- data-parallel gradient bytes: the PowerSGD compressor's ``bytes_per_step()`` when the run
  compresses, else the ring all-reduce bytes of this rank's trainable gradients
  (``2 (d-1)/d * numel * element size`` over the data-parallel size ``d``), the same formula.

    deepspeed --num_accelerators 2 benchmarks/_train_probe.py --config c.json --report_dir out --warmup 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from stormshard.parallel.counter import CommCounter  # noqa: E402
from stormshard.parallel.shapes import group_size  # noqa: E402
from stormshard.training.config import load_experiment_config  # noqa: E402
from stormshard.training.launch import init_distributed  # noqa: E402
from stormshard.training.loop import Trainer, preflight  # noqa: E402


def _ring_bytes(numel: int, element_size: int, world: int) -> int:
    return numel * element_size * 2 * (world - 1) // world


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--report_dir", required=True)
    parser.add_argument("--warmup", type=int, default=3, help="optimizer steps before the counter opens")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None)
    args = parser.parse_args(argv)
    if args.local_rank is not None:
        os.environ.setdefault("LOCAL_RANK", str(args.local_rank))

    cfg = load_experiment_config(args.config)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    inputs = preflight(cfg, world)
    init_distributed()
    trainer = Trainer(cfg, inputs=inputs)
    engine = trainer.engine
    counter = CommCounter()
    state = {"boundaries": 0, "measured": 0, "snapshot": None}

    original_step = engine.step

    def counted_step() -> bool:
        boundary = original_step()
        if boundary:
            state["boundaries"] += 1
            if state["boundaries"] == args.warmup:
                counter.reset()
            elif state["boundaries"] > args.warmup:
                state["measured"] += 1
        return boundary

    original_validate = trainer.validate

    def uncounted_validate():  # noqa: ANN202
        if state["snapshot"] is None:  # validation_interval > max_steps: only the final one runs
            state["snapshot"] = counter.as_dict()
        return original_validate()

    engine.step = counted_step  # instance attributes: the loop calls self.engine.step / self.validate
    trainer.validate = uncounted_validate
    with counter:
        trainer.fit()

    dp_group = trainer.groups.data_parallel_group
    dp = group_size(dp_group)
    trainable = [p for p in engine.module.parameters() if p.requires_grad]
    numel = sum(p.numel() for p in trainable)
    element = trainable[0].element_size()
    compressor = getattr(engine, "compressor", None)
    if compressor is not None:
        sb = compressor.bytes_per_step()
        grad_bytes = {"compressed": sb.compressed, "exact": sb.exact, "compressed_calls": sb.compressed_calls,
                      "exact_calls": sb.exact_calls, "source": "PowerSGDCompressor.bytes_per_step()"}
    else:
        exact = _ring_bytes(numel, element, dp)
        grad_bytes = {"compressed": None, "exact": exact, "compressed_calls": None,
                      "exact_calls": None, "source": "ring all-reduce of the trainable gradients"}
    measured = max(1, state["measured"])
    comm = state["snapshot"] or counter.as_dict()
    report = {
        "rank": dist.get_rank() if dist.is_initialized() else 0,
        "world": world,
        "data_parallel_size": dp,
        "gpus_per_model": trainer.layout.gpus_per_model,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "cuda_max_allocated_mib": (torch.cuda.max_memory_allocated() / 2**20) if torch.cuda.is_available() else None,
        "trainable_numel": numel,
        "effective_batch": trainer.plan_batch.effective_batch,
        "measured_steps": state["measured"],
        "stormshard_comm_per_step": {k: {"calls": v["calls"] / measured, "bytes": v["bytes"] / measured}
                                     for k, v in comm.items()},
        "grad_allreduce_bytes_per_step": grad_bytes,
    }
    out = Path(args.report_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{report['rank']}.json").write_text(json.dumps(report, indent=1))
    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
