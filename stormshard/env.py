"""The ``STORMSHARD_*`` environment variables: one typed reader per kind, one table of them all.

Every reader of a ``STORMSHARD_*`` variable goes through :func:`env_float`, :func:`env_int`,
:func:`env_choice` or :func:`env_json_object`: a value that is not a number, ``nan``, ``inf``, below
the variable's minimum, not one of its choices, not a JSON object or an object with an unknown key is
one :class:`EnvError` (a ``ValueError``: bad input, exit status 2) naming the variable, the value and
the fix. An empty value (``export STORMSHARD_X=``) counts as unset, as in the shell.

:data:`VARIABLES` lists the variables whose rule needs nothing above this floor (numbers and
switches); :func:`check_environment` reads them all at once (the training preflight calls it before
any work). The rule of ``STORMSHARD_COMPILE_BACKEND`` (torch's backend names) and of
``STORMSHARD_FLEX_KERNEL_OPTIONS`` (flex attention's option keys) live with their readers
(:mod:`stormshard.models.compile`, :mod:`stormshard.kernels.flex`), which use the same readers.

This module imports nothing from stormshard and no third-party package.
"""

from __future__ import annotations

import difflib
import json
import math
import os
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

__all__ = ["EnvError", "EnvVariable", "VARIABLES", "env_float", "env_int", "env_choice", "env_json_object",
           "check_environment", "raw_value"]


#: the largest magnitude a numeric variable may hold (seconds: about 115 days; a C int holds it; a timedelta too)
MAXIMUM = 1e7


class EnvError(ValueError):
    """A ``STORMSHARD_*`` environment variable whose value cannot work; the message names it."""


def raw_value(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The stripped value of ``name`` in ``env`` (default ``os.environ``); None when unset or empty."""
    raw = (os.environ if env is None else env).get(name, "")
    raw = raw.strip()
    return raw or None


def _number(name: str, raw: str, default: float, unit: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        raise EnvError(f"{name}={raw!r} is not a number{unit}: unset it (default {default:g}) or give e.g. "
                       f"{default:g}") from None
    if not math.isfinite(value):
        raise EnvError(f"{name}={raw!r} is not a finite number{unit}: unset it (default {default:g}) or give e.g. "
                       f"{default:g}")
    if abs(value) > MAXIMUM:  # beyond what a timer, a C int or a timedelta takes
        raise EnvError(f"{name}={raw!r} is above the largest value stormshard takes, {MAXIMUM:g}{unit} (115 days "
                       f"of seconds): unset it (default {default:g}) or give e.g. {default:g}")
    return value


def _at_least(name: str, raw: str, value: float, minimum: float | None, positive: bool, default: float) -> None:
    if positive and value <= 0:
        raise EnvError(f"{name}={raw!r} must be positive: unset it (default {default:g}) or give e.g. {default:g}")
    if minimum is not None and value < minimum:
        raise EnvError(f"{name}={raw!r} is below its minimum {minimum:g}"
                       f"{' (it is negative)' if value < 0 else ''}: unset it (default {default:g}) or give e.g. "
                       f"{default:g}")


def env_float(name: str, default: float, *, minimum: float | None = None, positive: bool = False, unit: str = "",
              env: Mapping[str, str] | None = None) -> float:
    """The finite number ``name`` holds (``default`` when unset), at least ``minimum`` and, with
    ``positive``, above 0; ``unit`` ("seconds") words the message."""
    raw = raw_value(name, env)
    if raw is None:
        return float(default)
    of = f" of {unit}" if unit else ""
    value = _number(name, raw, default, of)
    _at_least(name, raw, value, minimum, positive, default)
    return value


def env_int(name: str, default: int, *, minimum: int | None = None, positive: bool = False, unit: str = "",
            env: Mapping[str, str] | None = None) -> int:
    """The integer ``name`` holds (``default`` when unset; ``4.0`` is 4, ``4.5`` an error), at least ``minimum``."""
    raw = raw_value(name, env)
    if raw is None:
        return int(default)
    of = f" of {unit}" if unit else ""
    value = _number(name, raw, default, of)
    if value != int(value):
        raise EnvError(f"{name}={raw!r} is not a whole number{of}: unset it (default {default}) or give e.g. {default}")
    _at_least(name, raw, value, minimum, positive, default)
    return int(value)


def env_choice(name: str, default: str, choices: Collection[str], env: Mapping[str, str] | None = None) -> str:
    """The value of ``name``, one of ``choices`` (``default`` when unset)."""
    raw = raw_value(name, env)
    if raw is None:
        return default
    if raw not in choices:
        close = difflib.get_close_matches(raw, list(choices), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise EnvError(f"{name}={raw!r} is not one of {sorted(choices)}: {hint}unset it (default {default!r}) or "
                       "give one of them")
    return raw


def env_json_object(name: str, *, example: str, allowed: Callable[[str], bool] | Collection[str] | None = None,
                    known: Collection[str] = (), env: Mapping[str, str] | None = None) -> dict | None:
    """The JSON object ``name`` holds (None when unset). ``allowed`` (a set of keys or a predicate; None:
    any) refuses unknown keys, naming them (with a did-you-mean among ``known``); ``example`` is a
    valid value for the message."""
    raw = raw_value(name, env)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as err:
        raise EnvError(f"{name}={raw!r} is not a JSON object ({err}): set it to e.g. '{example}' or unset it") \
            from None
    if not isinstance(value, dict):
        raise EnvError(f"{name}={raw!r} must be a JSON object, e.g. '{example}', or unset")
    if allowed is not None:
        ok = allowed if callable(allowed) else set(allowed).__contains__
        unknown = [k for k in value if not ok(k)]
        if unknown:
            hints = [f"{k!r} (did you mean {c[0]!r}?)" if (c := difflib.get_close_matches(k, list(known), n=1))
                     else repr(k) for k in unknown]
            raise EnvError(f"{name}={raw!r}: unknown key(s) {', '.join(hints)}: remove them"
                           + (f"; the known keys are {', '.join(sorted(known))}" if known else ""))
    return value


@dataclass(frozen=True)
class EnvVariable:
    """A ``STORMSHARD_*`` variable of :data:`VARIABLES`: its name, default and rule; :meth:`read` reads it."""

    name: str
    default: float | str
    kind: str  # "seconds" (a finite number of seconds), "switch" ("0" or "1")
    positive: bool = False  # seconds: above 0 (else at least 0)

    def read(self, env: Mapping[str, str] | None = None) -> float | str:
        if self.kind == "switch":
            return env_choice(self.name, str(self.default), ("0", "1"), env)
        return env_float(self.name, float(self.default), minimum=0.0, positive=self.positive, unit="seconds", env=env)


#: every STORMSHARD_* variable whose rule needs nothing above this floor
VARIABLES: dict[str, EnvVariable] = {v.name: v for v in (
    EnvVariable("STORMSHARD_DIST_TIMEOUT", 600.0, "seconds", positive=True),  # the process-group timeout
    EnvVariable("STORMSHARD_RENDEZVOUS_TIMEOUT", 60.0, "seconds", positive=True),  # the start's rendezvous
    EnvVariable("STORMSHARD_HEARTBEAT_S", 1.0, "seconds"),  # 0 turns the rank monitor off
    EnvVariable("STORMSHARD_DEAD_AFTER_S", 10.0, "seconds", positive=True),
    EnvVariable("STORMSHARD_MALLOC_TUNING", "1", "switch"),  # 0 leaves glibc's malloc alone
    EnvVariable("STORMSHARD_RUN_LOCK_STALE_S", 120.0, "seconds", positive=True),  # an output_dir lock left unrefreshed
)}


def check_environment(env: Mapping[str, str] | None = None) -> dict[str, float | str]:
    """Every variable of :data:`VARIABLES` read once (an :class:`EnvError` names the first bad one);
    their values."""
    return {name: var.read(env) for name, var in VARIABLES.items()}
