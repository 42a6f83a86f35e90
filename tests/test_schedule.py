"""Warm-up + cosine learning-rate schedule: the pure function, the LambdaLR, the validation."""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from stormshard.training.schedule import LRScheduleSettings, build_scheduler, lr_at


def test_lr_at_shape():
    s = LRScheduleSettings(lr=1e-3, lr_min=1e-5, warmup_steps=4, total_steps=14)
    assert [lr_at(i, s) for i in range(4)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3], rel=1e-12)
    assert lr_at(4, s) == pytest.approx(1e-3, rel=1e-12)  # decay starts from the peak
    assert lr_at(9, s) == pytest.approx((1e-3 + 1e-5) / 2, rel=1e-12)  # half way: cos = 0
    assert lr_at(13, s) == pytest.approx(1e-5 + (1e-3 - 1e-5) * 0.5 * (1 + math.cos(math.pi * 0.9)), rel=1e-12)
    assert lr_at(14, s) == lr_at(1000, s) == 1e-5
    decay = [lr_at(i, s) for i in range(4, 15)]
    assert all(a > b for a, b in zip(decay, decay[1:], strict=False))


def test_edge_settings():
    no_warmup = LRScheduleSettings(lr=0.1, lr_min=0.0, warmup_steps=0, total_steps=2)
    assert [lr_at(i, no_warmup) for i in range(3)] == pytest.approx([0.1, 0.05, 0.0], abs=1e-15)
    constant = LRScheduleSettings(lr=0.1, lr_min=0.1, warmup_steps=0, total_steps=5)
    assert {lr_at(i, constant) for i in range(8)} == {0.1}
    all_warmup = LRScheduleSettings(lr=0.1, warmup_steps=3, total_steps=3, lr_min=0.01)
    assert [lr_at(i, all_warmup) for i in range(4)] == pytest.approx([0.1 / 3, 0.2 / 3, 0.1, 0.01], rel=1e-12)
    with pytest.raises(ValueError, match="step must be >= 0"):
        lr_at(-1, no_warmup)


def test_scheduler_follows_lr_at():
    s = LRScheduleSettings(lr=0.05, lr_min=0.005, warmup_steps=3, total_steps=10)
    param = torch.nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([param], lr=123.0)  # the schedule overrides the optimizer's lr
    sched = build_scheduler(opt, s)
    seen = []
    for _ in range(12):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([lr_at(i, s) for i in range(12)], rel=1e-12)
    # resumes from its state dict
    again = build_scheduler(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]), s)
    again.load_state_dict(sched.state_dict())
    assert again.get_last_lr() == sched.get_last_lr()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lr": 1e-3, "lr_min": 1e-2}, "lr_min=0.01 is above schedule.lr=0.001"),
        ({"warmup_steps": 20, "total_steps": 10}, "warmup_steps=20 exceeds schedule.total_steps=10"),
        ({"lr": 0.0}, "lr"),
        ({"lr": float("inf")}, "lr"),
        ({"lr_min": -1.0}, "lr_min"),
        ({"warmup_steps": -1}, "warmup_steps"),
        ({"total_steps": 0}, "total_steps"),
        ({"steps": 10}, "steps"),
    ],
)
def test_bad_schedule(kwargs, match):
    with pytest.raises(ValidationError, match=match):
        LRScheduleSettings(**kwargs)


# --------------------------------------------------------------------------------------------
# rank-0 logging (stormshard.training.metrics_log)
# --------------------------------------------------------------------------------------------


def test_metrics_log_jsonl_and_progress(tmp_path):
    import io
    import json

    from stormshard.training.metrics_log import MetricsLogger

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    stream = Terminal()  # a terminal: a tqdm bar
    with MetricsLogger(tmp_path, total_steps=3, stream=stream) as log:
        for step in (1, 2, 3):
            log.log(step, {"loss": torch.tensor(1.0 / step), "lr": 0.1, "bad": float("nan")}, samples=8)
        log.write("done")
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3]
    assert lines[1]["loss"] == pytest.approx(0.5) and lines[0]["bad"] is None
    assert "samples_per_s" not in lines[0] and lines[2]["samples_per_s"] > 0
    out = stream.getvalue()
    assert "done" in out and "3/3" in out and "loss=0.3333" in out and "samples/s=" in out
    # a log file (not a terminal): plain lines at the first and the last step (every_s apart between), no \r
    stream = io.StringIO()
    with MetricsLogger(tmp_path / "file", total_steps=3, stream=stream) as log:
        for step in (1, 2, 3):
            log.log(step, {"loss": 1.0 / step}, samples=8)
        log.write("done")
    out = stream.getvalue()
    assert "\r" not in out and [x.split(" |")[0] for x in out.splitlines()] == ["step 1/3 (33%)", "step 3/3 (100%)", "done"]
    # other ranks write nothing
    other = MetricsLogger(tmp_path / "rank1", rank=1, wandb=True)
    assert other.log(1, {"loss": 1.0}) == {} and not (tmp_path / "rank1").exists()
    other.close()
    with pytest.raises(ValueError, match="wandb_mode"):
        MetricsLogger(tmp_path, wandb_mode="cloud")


def test_metrics_log_wandb_offline(tmp_path, monkeypatch):
    import io

    pytest.importorskip("wandb")
    from stormshard.training.metrics_log import MetricsLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    with MetricsLogger(tmp_path, wandb=True, progress=False, config={"lr": 0.1}, stream=io.StringIO()) as log:
        assert log.wandb_run is not None
        log.log(1, {"loss": 0.5})
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


def test_format_table():
    from stormshard.training.metrics_log import format_table, rmse_rows

    rows = rmse_rows({"t2m": 1.23456, "z500": 45.6}, {"t2m": 2.0, "z500": 40.0})
    assert rows[0]["skill"] == pytest.approx(1 - 1.23456 / 2.0)
    table = format_table(rows)
    lines = table.splitlines()
    assert lines[0].split() == ["variable", "rmse", "persistence", "skill"]
    assert lines[2].split() == ["t2m", "1.235", "2", "0.3827"]
    assert lines[3].split() == ["z500", "45.6", "40", "-0.14"]
    assert len({len(line) for line in lines[:2]}) == 1  # header and rule aligned
    assert format_table([]) == "(no rows)"
    assert format_table([{"a": 1}, {"b": "x"}]).splitlines()[2].split() == ["1", "-"]
    with pytest.raises(ValueError, match="unmatched"):
        rmse_rows({"t2m": 1.0}, {"u10": 1.0})
