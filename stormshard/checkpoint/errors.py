"""The one exception checkpoint conversion raises: it lists every difference it found."""

from __future__ import annotations

from collections.abc import Sequence

from stormshard.training.checkpoint import CheckpointError

__all__ = ["ConversionError"]


class ConversionError(CheckpointError):
    """A checkpoint that cannot be converted: missing, extra or mis-shaped tensors, incomplete
    shards, missing or unreadable rank files, or a layout the target cannot take.

    ``problems`` holds one line per difference; the message lists them and says what to do.
    Nothing has been written when this is raised.
    """

    def __init__(self, what: str, problems: Sequence[str] = (), fix: str = "") -> None:
        self.problems = [str(p) for p in problems]
        lines = [what]
        shown = self.problems[:40]
        lines += [f"  - {p}" for p in shown]
        if len(self.problems) > len(shown):
            lines.append(f"  ... and {len(self.problems) - len(shown)} more")
        if fix:
            lines.append(fix)
        super().__init__("\n".join(lines))
