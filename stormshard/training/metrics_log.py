"""Rank-0 logging: progress (a tqdm bar on a terminal, plain periodic lines in a log file), metrics
as JSON lines, wandb offline, a results table.

Only rank 0 writes; on other ranks every method is a no-op, so training code calls it everywhere::

    with MetricsLogger("runs/quick", rank=rank, total_steps=200, wandb=True, config=cfg) as log:
        for step in ...:
            log.log(step, {"loss": loss.item(), "lr": engine.lr}, samples=effective_batch)
        log.write(format_table(rmse_rows(rmse, persistence)))

``metrics.jsonl`` gets one JSON object per call: ``{"step", "time", "samples_per_s", **metrics}``
(non-finite numbers are written as null). A resumed run first drops the records an interrupted run
logged after its last checkpoint (:func:`drop_records_after`), so every step appears once. wandb runs in offline mode unless told otherwise, so it
never needs a network, and is skipped (with a note) when it is not installed.

Progress (``progress=True``) is a tqdm bar when the stream (standard error) is a terminal; otherwise
(redirected to a file, a batch job's log) a bar would write ``\r`` frames, so a plain line
(:class:`~stormshard.progress.PeriodicLine`: step, loss, samples/s, elapsed, ETA) is printed at the
first logged step, every ``every_s`` seconds and at the last step.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, TextIO

from torch import Tensor

from stormshard.progress import PeriodicLine

__all__ = ["MetricsLogger", "format_table", "rmse_rows", "lead_time_rows", "drop_records_after", "logged_keys"]


def _number(value: Any) -> Any:
    if isinstance(value, Tensor):
        value = value.detach().item() if value.numel() == 1 else value.detach().tolist()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def drop_records_after(path: str | os.PathLike, step: int) -> int:
    """Rewrite the JSON-lines file ``path`` without its records past ``step`` (and without a line cut
    short by a killed writer), atomically: a temporary file, fsync, ``os.replace``. Returns how many
    lines were dropped (0, and nothing rewritten, when there are none or no file)."""
    p = Path(path)
    if not p.is_file():
        return 0
    kept, dropped = [], 0
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            dropped += 1
            continue
        at = record.get("step") if isinstance(record, dict) else None
        if isinstance(at, int) and at > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        tmp = p.with_name(p.name + ".part")
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in kept))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    return dropped


def logged_keys(path: str | os.PathLike, step: int) -> set[str]:
    """The metric names the JSON-lines file ``path`` holds at ``step`` (empty without a file; lines that
    do not parse are skipped): whether a validation was logged there already."""
    p = Path(path)
    if not p.is_file():
        return set()
    keys: set[str] = set()
    for line in p.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step") == step:
            keys.update(record)
    return keys


class MetricsLogger:
    """Progress (bar or periodic lines), JSON lines and (optionally) wandb on rank 0; silent elsewhere."""

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        rank: int = 0,
        total_steps: int | None = None,
        initial_step: int = 0,
        progress: bool = True,
        wandb: bool = False,
        wandb_mode: Literal["offline", "online", "disabled"] = "offline",
        project: str = "stormshard",
        run_name: str | None = None,
        config: Mapping[str, Any] | None = None,
        stream: TextIO | None = None,
        every_s: float = 30.0,
    ) -> None:
        if wandb_mode not in ("offline", "online", "disabled"):
            raise ValueError(f"wandb_mode must be 'offline', 'online' or 'disabled', got {wandb_mode!r}")
        self.rank = rank
        self.enabled = rank == 0
        self.directory = Path(directory)
        self.path = self.directory / "metrics.jsonl"
        self._bar = None
        self._line: PeriodicLine | None = None
        self._file = None
        self._wandb_run = None
        self._last_time: float | None = None
        self._stream = stream if stream is not None else sys.stderr
        if not self.enabled:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        if progress and not _is_terminal(self._stream):
            self._line = PeriodicLine(total_steps, initial=initial_step, every_s=every_s, stream=self._stream)
        elif progress:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total_steps, initial=initial_step, desc="train", unit="step",
                             dynamic_ncols=True, file=self._stream)
        if wandb and wandb_mode != "disabled":
            self._wandb_run = self._start_wandb(wandb_mode, project, run_name, config)

    def _start_wandb(self, mode: str, project: str, run_name: str | None, config: Mapping[str, Any] | None) -> Any:
        os.environ.setdefault("WANDB_MODE", mode)
        os.environ.setdefault("WANDB_SILENT", "true")
        try:
            import wandb
        except ImportError:
            self.write("wandb is not installed: logging to metrics.jsonl only")
            return None
        return wandb.init(project=project, name=run_name, mode=mode, dir=str(self.directory),
                          config=dict(config) if config is not None else None, reinit=True)

    @property
    def wandb_run(self) -> Any:
        return self._wandb_run

    def log(self, step: int, metrics: Mapping[str, Any], samples: int | None = None) -> dict[str, Any]:
        """Record ``metrics`` at ``step``; ``samples`` processed since the previous call give samples/s.
        Returns the record written (empty on ranks other than 0)."""
        if not self.enabled:
            return {}
        now = time.perf_counter()
        record: dict[str, Any] = {"step": int(step), "time": time.time()}
        if samples is not None and self._last_time is not None and now > self._last_time:
            record["samples_per_s"] = samples / (now - self._last_time)
        self._last_time = now
        record.update({k: _number(v) for k, v in metrics.items()})
        if self._file is None:
            raise RuntimeError("the logger is closed")
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._bar is not None:
            shown = {k: record[k] for k in ("loss", "samples_per_s") if record.get(k) is not None}
            self._bar.set_postfix({k.replace("samples_per_s", "samples/s"): f"{v:.4g}" for k, v in shown.items()},
                                  refresh=False)
            self._bar.update(max(0, int(step) - self._bar.n))
        if self._line is not None and "loss" in record:  # training steps, not validation records
            self._line.update(int(step), loss=record["loss"], samples=samples)
        if self._wandb_run is not None:
            self._wandb_run.log({k: v for k, v in record.items() if k not in ("step", "time")}, step=int(step))
        return record

    def write(self, message: str) -> None:
        """Print ``message`` on rank 0 without breaking the progress bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.write(message, file=self._stream)
        else:
            print(message, file=self._stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._wandb_run is not None:
            self._wandb_run.finish()
            self._wandb_run = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _cell(value: Any, floatfmt: str) -> str:
    value = _number(value)
    if isinstance(value, float):
        return format(value, floatfmt)
    return "-" if value is None else str(value)


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                 floatfmt: str = ".4g") -> str:
    """A plain-text table: a header, a rule, one line per row; text left-aligned, numbers right-aligned.
    ``columns`` defaults to the keys of the rows in first-seen order; missing cells print ``-``."""
    if not rows:
        return "(no rows)"
    if columns is None:
        columns = list(dict.fromkeys(k for row in rows for k in row))
    cells = [[_cell(row.get(c), floatfmt) for c in columns] for row in rows]
    numeric = [all(isinstance(_number(row.get(c)), (int, float)) or row.get(c) is None for row in rows)
               for c in columns]
    widths = [max(len(str(c)), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric, strict=True))

    return "\n".join([line([str(c) for c in columns]).rstrip(), "  ".join("-" * w for w in widths),
                      *(line(r).rstrip() for r in cells)])


def rmse_rows(rmse: Mapping[str, float], persistence: Mapping[str, float]) -> list[dict[str, Any]]:
    """Rows ``variable | rmse | persistence | skill`` with skill = 1 - rmse / persistence (higher is
    better; 0 = no better than persistence), for :func:`format_table`."""
    missing = sorted(set(rmse) ^ set(persistence))
    if missing:
        raise ValueError(f"rmse and persistence must name the same variables; unmatched: {missing}")
    rows = []
    for name in rmse:
        model, base = float(_number(rmse[name])), float(_number(persistence[name]))
        rows.append({"variable": name, "rmse": model, "persistence": base,
                     "skill": 1.0 - model / base if base > 0 else float("nan")})
    return rows


def lead_time_rows(rmse: Mapping[str, Mapping[str, float]],
                   persistence: Mapping[str, Mapping[str, float]]) -> list[dict[str, Any]]:
    """Rows ``variable | lead | rmse | persistence | skill`` from ``{lead: {variable: value}}``
    (lead times in order, variables grouped), for :func:`format_table`."""
    if list(rmse) != list(persistence):
        raise ValueError(f"rmse and persistence must have the same lead times; got {list(rmse)} and "
                         f"{list(persistence)}")
    per_lead = {lead: rmse_rows(rmse[lead], persistence[lead]) for lead in rmse}
    variables = [row["variable"] for row in next(iter(per_lead.values()), [])]
    rows = []
    for i, name in enumerate(variables):
        for lead, lead_rows in per_lead.items():
            row = lead_rows[i]
            rows.append({"variable": name, "lead": lead, "rmse": row["rmse"], "persistence": row["persistence"],
                         "skill": row["skill"]})
    return rows
