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

import os
import sys
from pathlib import Path

from stormshard.models.config import builder_module

__all__ = ["OPT_IN", "UntrustedModelCode", "check_model_code", "stored_beside", "module_source"]

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


def stored_beside(config_file: str | os.PathLike, model_name: object = None) -> Path | None:
    """What marks ``config_file`` as a stored file, not the user's own (None: nothing does):

    - a ``metadata.json`` beside it (a bundle's or checkpoint's, whatever it holds: a downloaded folder
      controls its contents);
    - a run's ``checkpoints`` folder or ``metrics.jsonl`` beside it (a run's saved ``config.json``);
    - the source of the builder module ``model_name`` names lying inside the config file's folder (found on
      ``sys.path`` by file name only, nothing imported): a folder that ships its own code.
    """
    folder = Path(config_file).absolute().parent
    for marker in ("metadata.json", "checkpoints", "metrics.jsonl"):
        if (folder / marker).exists():
            return folder / marker
    if isinstance(model_name, str):
        try:
            module = builder_module(model_name)
        except ValueError:
            return None
        source = module_source(module) if module else None
        if source is not None and folder in source.parents:
            return source
    return None


def module_source(module: str) -> Path | None:
    """The file (or folder) ``import module`` would load, found by name alone on ``sys.path`` (the first entry
    holding its top-level package or module, as import does): no import, no ``find_spec`` (which imports
    parent packages). None when no entry holds it."""
    parts = module.split(".")
    for entry in sys.path:
        base = Path(entry or os.getcwd()).absolute()
        if base.joinpath(parts[0] + ".py").is_file():
            return base.joinpath(parts[0] + ".py")
        if base.joinpath(parts[0]).is_dir():
            deepest = base.joinpath(*parts)
            for candidate in (deepest.with_suffix(".py"), deepest):
                if candidate.exists():
                    return candidate
            return base.joinpath(parts[0])
    return None
