"""Where conversion writes: an output that is free, replaced atomically.

``check_output_free`` (an existing ``--out`` needs
``--overwrite``), :class:`atomic_directory` (write into a temporary directory, rename at the end) and
``save_safetensors``; :mod:`stormshard.checkpoint.consolidate` re-exports them for its callers.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from torch import Tensor

from stormshard.checkpoint.errors import ConversionError
from stormshard.errors import disk_full_error, is_disk_full

__all__ = ["check_output_free", "atomic_directory", "save_safetensors"]


def check_output_free(out: str | os.PathLike, overwrite: bool = False) -> None:
    """A :class:`ConversionError` naming ``--out`` unless it may be written: absent, an empty directory,
    or ``overwrite``. The check :class:`atomic_directory` makes, for the callers to make before they
    read their source (an existing output is bad input: no work first)."""
    p = Path(out)
    if p.exists() and not overwrite and (not p.is_dir() or any(p.iterdir())):
        raise ConversionError(f"--out {out} exists already", fix="choose a new output path or pass --overwrite")


class atomic_directory:  # noqa: N801 - used as a context manager
    """``with atomic_directory(out) as tmp:`` write into ``tmp``; on success it is renamed to
    ``out`` (which must not exist unless ``overwrite``: then the old ``out``, a directory, a file or a link, is
    moved aside, put back if the rename fails, and deleted once the new one is in place); on an exception
    ``tmp`` is deleted."""

    def __init__(self, out: str | os.PathLike, overwrite: bool = False) -> None:
        self.out = Path(out)
        self.overwrite = overwrite
        check_output_free(self.out, overwrite)
        self.tmp = self.out.with_name(f".{self.out.name}.tmp-{os.getpid()}")

    def __enter__(self) -> Path:
        if self.tmp.exists():
            shutil.rmtree(self.tmp)
        self.created = [p for p in reversed(self.tmp.parents) if not p.exists()]
        self.tmp.mkdir(parents=True)
        return self.tmp

    def __exit__(self, exc_type, exc, tb) -> None:  # noqa: ANN001
        if exc_type is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
            for parent in reversed(self.created):  # leave no empty directories behind either
                try:
                    parent.rmdir()
                except OSError:
                    break
            if is_disk_full(exc):  # name the output, not the temporary file write() hit
                raise disk_full_error(exc, self.out) from exc
            return
        if not (self.out.exists() or self.out.is_symlink()):
            os.replace(self.tmp, self.out)
            return
        old = self.out.with_name(f".{self.out.name}.old-{os.getpid()}")
        os.replace(self.out, old)  # a file, a link or a directory (--overwrite): kept until the new one is in place
        try:
            os.replace(self.tmp, self.out)
        except BaseException:
            os.replace(old, self.out)
            shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink(missing_ok=True)


def save_safetensors(tensors: Mapping[str, Tensor], path: Path, metadata: Mapping[str, str] | None = None) -> None:
    from safetensors.torch import save_file

    save_file({k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}, str(path),
              metadata=dict(metadata or {}))
