"""Reading a step's loss one step late (what :meth:`Trainer.fit` does on CUDA, so that the host never waits
for the device between steps) changes nothing the run records: the same losses, the same metrics records
(the learning rate after each step included), and a non-finite loss still stops the run before anything
is saved. Forced on a CPU here (``Trainer.read_loss_late``), over 2 data-parallel ranks."""

from __future__ import annotations

import json
from pathlib import Path

from tests.distributed import run_distributed
from tests.tiny_run import tiny_config


def _train(rank: int, world: int, cfg: dict, late: bool, poison_step: int | None = None,
           fail_step: int | None = None) -> object:
    import torch

    from stormshard.training import loop
    from stormshard.training.launch import run_training

    # patched in this worker process only for this run (the rank pools persist across tests): put back below
    saved = loop.Trainer.__dict__["read_loss_late"], loop.Trainer.__dict__["train_step"]
    loop.Trainer.read_loss_late = property(lambda self: late)
    if poison_step is not None:  # the loss of one step becomes NaN (as a diverged model's would)
        original = loop.Trainer.train_step

        def poisoned(self, step):  # noqa: ANN001, ANN202
            loss = original(self, step)
            return loss * torch.nan if step == poison_step else loss

        loop.Trainer.train_step = poisoned
    if fail_step is not None:  # one step fails (out of memory, a lost rank) after the step before was queued
        original_step = loop.Trainer.train_step

        def failing(self, step):  # noqa: ANN001, ANN202
            if step == fail_step:
                raise RuntimeError("CUDA out of memory (simulated)")
            return original_step(self, step)

        loop.Trainer.train_step = failing
    try:
        return run_training(cfg).losses
    except (FloatingPointError, RuntimeError) as err:
        return str(err)
    finally:
        loop.Trainer.read_loss_late, loop.Trainer.train_step = saved


def _records(out: Path) -> list[dict]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        r.pop("step_time", None), r.pop("data_wait", None), r.pop("samples_per_s", None), r.pop("time", None)
    return records


def test_late_loss_readout_records_the_same_run(dataset, tmp_path):
    changes = {"training.max_steps": 7, "training.checkpoint_interval": 3, "training.validation_interval": 5,
               "parallel.gpus_per_model": 1, "training.micro_batch_size": 1}
    runs = {}
    for late in (False, True):
        out = tmp_path / f"late_{late}"
        runs[late] = (run_distributed(_train, 2, tiny_config(dataset, out, **changes), late)[0], _records(out))
    assert runs[True][0] == runs[False][0]
    assert runs[True][1] == runs[False][1]


def test_a_nan_loss_read_late_stops_before_the_next_checkpoint(dataset, tmp_path):
    out = tmp_path / "nan"
    cfg = tiny_config(dataset, out, **{"training.max_steps": 6, "training.checkpoint_interval": 3})
    message = run_distributed(_train, 1, cfg, True, 3)[0]
    assert isinstance(message, str) and "at step 3" in message, message
    saved = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    assert saved == ["step_00000003"], saved  # step 6's checkpoint was never written


def test_a_failing_step_does_not_lose_the_loss_of_the_step_before(dataset, tmp_path):
    out = tmp_path / "fail"
    cfg = tiny_config(dataset, out, **{"training.max_steps": 6, "training.checkpoint_interval": 6,
                                       "logging.log_interval": 1})
    message = run_distributed(_train, 1, cfg, True, None, 4)[0]
    assert "out of memory" in message, message
    steps = [r["step"] for r in _records(out) if "loss" in r]
    assert steps == [1, 2, 3, 4], steps  # step index 3 (logged as 4) was read late, when step index 4 failed
