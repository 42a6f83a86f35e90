"""Expand SLURM host lists (``SLURM_JOB_NODELIST``) without calling ``scontrol``.

``expand_hostlist("node[01-03,07],gpu-a[1-2]-ib")`` ->
``["node01", "node02", "node03", "node07", "gpu-a1-ib", "gpu-a2-ib"]``. Ranges keep their zero
padding (``[08-10]`` -> ``08, 09, 10``); several bracket groups in one name expand as a product in
the order ``scontrol show hostnames`` prints them (the last group varies fastest).
"""

from __future__ import annotations

import itertools

__all__ = ["HostlistError", "expand_hostlist", "first_host"]


class HostlistError(ValueError):
    """A host list that is not in SLURM's ``prefix[a-b,c]suffix,...`` form."""


def _split_top_level(text: str) -> list[str]:
    """Split at commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"host list {text!r}: nested '[' at position {i}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"host list {text!r}: ']' without '[' at position {i}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise HostlistError(f"host list {text!r}: '[' is not closed")
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def _expand_range_list(body: str, whole: str) -> list[str]:
    """``"01-03,07"`` -> ``["01", "02", "03", "07"]`` (padding kept)."""
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        lo, sep, hi = item.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise HostlistError(f"host list {whole!r}: range {item!r} is not 'N' or 'N-M' with digits")
        if not sep:
            out.append(lo)
            continue
        a, b = int(lo), int(hi)
        if b < a:
            raise HostlistError(f"host list {whole!r}: range {item!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(a, b + 1))
    return out


def _expand_one(name: str, whole: str) -> list[str]:
    pieces: list[list[str]] = []
    rest = name
    while "[" in rest:
        head, _, tail = rest.partition("[")
        body, closed, rest = tail.partition("]")
        if not closed:
            raise HostlistError(f"host list {whole!r}: '[' is not closed")
        pieces.append([head])
        pieces.append(_expand_range_list(body, whole))
    pieces.append([rest])
    return ["".join(parts) for parts in itertools.product(*pieces)]


def expand_hostlist(hostlist: str) -> list[str]:
    """Every host name of a SLURM host list, in order (duplicates kept, as ``scontrol`` does)."""
    if not isinstance(hostlist, str) or not hostlist.strip():
        raise HostlistError(f"host list {hostlist!r} is empty")
    hosts: list[str] = []
    for name in _split_top_level(hostlist.strip()):
        hosts.extend(_expand_one(name, hostlist))
    return hosts


def first_host(hostlist: str) -> str:
    """The first host of a SLURM host list (where task 0 of a block-distributed step runs)."""
    return expand_hostlist(hostlist)[0]
