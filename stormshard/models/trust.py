"""Model code a stored file names runs only when the user says so.

A bundle's or checkpoint's stored config (and a config file that came with one, such as a bundle's
``finetune_config.json``) may name its model builder as ``"package.module:attribute"``. Building that
model imports the module, which runs its top-level code, and a downloaded bundle may ship such a
module beside its weights (the launchers put the repository root, where the README keeps bundles
and runs, on ``sys.path``). :func:`check_model_code` refuses such a name unless the user opted in:
``--trust-model-code`` on the command line, ``trust_model_code=True`` in Python. Built-in and
registered names hold no ':' and never import anything. The decision is made from the name alone:
nothing the file names is imported, not even to look for it (``importlib.util.find_spec`` of a
dotted name imports its parent packages).

A builder named in the user's own config (``launch/train.py --config``, ``run_training``) is the
user's choice and needs no opt-in. Torch-free.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from stormshard.models.config import builder_module

__all__ = ["OPT_IN", "UntrustedModelCode", "check_model_code", "stored_beside"]

#: how the user opts in, on the command line and in Python
OPT_IN = "--trust-model-code (Python: trust_model_code=True)"


class UntrustedModelCode(ValueError):
    """A stored file names a builder module, which importing would run, and the user did not opt in."""


def check_model_code(name: object, where: str, trust_model_code: bool) -> None:
    """Raise :class:`UntrustedModelCode` naming ``where`` (the file), the module and the opt-in when
    ``name`` (a stored ``model.name``) is ``"package.module:attribute"`` and ``trust_model_code`` is
    False. A malformed name passes here: the config's validation names it."""
    if trust_model_code or not isinstance(name, str):
        return
    try:
        module = builder_module(name)
    except ValueError:
        return
    if module is not None:
        raise UntrustedModelCode(
            f"{where} names its model builder model.name={name!r}: building it would import the module "
            f"{module!r}, which runs that module's code, and stormshard does not run code named by a file it "
            f"loads on its own. Nothing was loaded or written. If you trust this file (you made it, or know "
            f"where it comes from), pass {OPT_IN}; otherwise do not use it"
        )


def stored_beside(config_file: str | os.PathLike) -> Path | None:
    """The ``metadata.json`` beside ``config_file`` when that file came with a bundle or checkpoint (a
    stormshard ``format`` in it), else None: such a config is a stored file, not the user's own."""
    meta = Path(config_file).parent / "metadata.json"
    try:
        fmt = json.loads(meta.read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return None
    return meta if isinstance(fmt, int) or isinstance(fmt, str) and fmt.startswith("stormshard") else None
