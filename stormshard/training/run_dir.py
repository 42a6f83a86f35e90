"""What a run may find in its ``training.output_dir`` (a preflight check, before any work).

- A new run (no ``--resume``) must not start in a directory that already holds a run: its
  checkpoints would be overwritten and a second run appended to its ``metrics.jsonl``. Checkpoints
  (``checkpoints/step_NNNNNNNN``, a ``latest`` pointer) or a non-empty ``metrics.jsonl`` count as a
  run; a graph cache does not.
- ``--resume`` continues the checkpoint ``latest`` names, which must be complete: readable
  ``metadata.json``, the current format, every file there with the size recorded at save
  (:func:`~stormshard.checkpoint.integrity.resume_target`: a damaged or empty ``latest``, a step it
  names that is missing, not a directory or incomplete, a newer step than it names each stop the run,
  naming the checkpoint to continue from instead; the sha256 of each rank's files is verified by
  :func:`~stormshard.training.checkpoint.verify_resume_files` before any file is written).
"""

from __future__ import annotations

from pathlib import Path

from stormshard.checkpoint.format import LATEST, list_checkpoints
from stormshard.checkpoint.integrity import resume_target
from stormshard.training.config import ConfigError, ExperimentConfig

__all__ = ["check_run_directory", "METRICS_FILE"]

METRICS_FILE = "metrics.jsonl"


def _earlier_run(output_dir: Path) -> tuple[str, bool]:
    """What of an earlier run ``output_dir`` holds (empty when nothing) and whether it has a checkpoint."""
    checkpoints = output_dir / "checkpoints"
    found = []
    complete = list_checkpoints(checkpoints)
    partial = sorted(p.name for p in checkpoints.glob("step_*")) if checkpoints.is_dir() else []
    if complete:
        found.append(f"checkpoints up to {complete[-1].name} in {checkpoints}")
    elif partial or (checkpoints / LATEST).exists():
        found.append(f"an incomplete checkpoint in {checkpoints} ({', '.join(partial[:3]) or LATEST})")
    metrics = output_dir / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        lines = sum(1 for line in metrics.read_text(errors="replace").splitlines() if line.strip())
        found.append(f"{metrics} with {lines} records")
    return " and ".join(found), bool(complete)


def check_run_directory(config: ExperimentConfig, resume: bool) -> None:
    """A new run's ``training.output_dir`` holds no earlier run; a resumed run's checkpoint (the one
    ``latest`` names) is complete. :class:`ConfigError` (or ``CheckpointError``) naming the directory and
    the fix."""
    output_dir = Path(config.training.output_dir)
    if resume:
        resume_target(output_dir / "checkpoints")
        return
    found, resumable = _earlier_run(output_dir)
    if not found:
        return
    fix = ("pass --resume to continue it, or set a new training.output_dir" if resumable else
           "it has no complete checkpoint to --resume from: set a new training.output_dir, or delete the directory")
    raise ConfigError(
        f"training.output_dir={str(output_dir)!r} already holds a run ({found}): {fix}; a new run there would "
        "overwrite its checkpoints and mix its metrics.jsonl. Nothing was started or changed"
    )
