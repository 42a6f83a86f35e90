"""What a shard strategy splits over the model group: the one rule, and the layers' guard.

The strategies are spelled in :mod:`stormshard.parallel.shard` (``ShardStrategy``). What each one
splits whole over the ranks of the group:

- ``shard_sequence``: nothing (each rank holds a slice of the sequence; any head count works);
- ``shard_heads``: the attention heads (an all-to-all trades sequence slices for head slices);
- ``tensor``: the attention heads and the MLP hidden channels (column / row-parallel linears).

:func:`indivisible_sizes` states that rule. The layers call :func:`check_strategy_name` and
:func:`check_split` at construction (a layer-level message); the model-level check,
:func:`stormshard.models.parallelize.check_parallel_strategy`, words the same rule in config fields.
"""

from __future__ import annotations

from collections.abc import Sequence

from stormshard.parallel.shard import SHARD_STRATEGIES

__all__ = ["SPLIT_SIZES", "indivisible_sizes", "check_strategy_name", "check_split"]

#: The sizes each strategy splits whole over the ranks of the group.
SPLIT_SIZES: dict[str, tuple[str, ...]] = {
    "shard_sequence": (),
    "shard_heads": ("num_heads",),
    "tensor": ("num_heads", "mlp_hidden"),
}
if set(SPLIT_SIZES) != set(SHARD_STRATEGIES):  # a developer error: a strategy without its rule
    raise RuntimeError(f"SPLIT_SIZES {sorted(SPLIT_SIZES)} != SHARD_STRATEGIES {sorted(SHARD_STRATEGIES)}")


def indivisible_sizes(shard_strategy: str, world: int, *, num_heads: int | None = None,
                      mlp_hidden: int | None = None) -> dict[str, int]:
    """The sizes ``shard_strategy`` splits over ``world`` ranks that ``world`` does not divide.

    ``{"num_heads": 6}`` for 6 heads, ``"shard_heads"`` and 4 ranks; empty when the split works.
    A size given as None is not checked (an attention alone has no MLP). ``shard_strategy`` must
    be one of ``SHARD_STRATEGIES``.
    """
    sizes = {"num_heads": num_heads, "mlp_hidden": mlp_hidden}
    return {name: sizes[name] for name in SPLIT_SIZES[shard_strategy]
            if sizes[name] is not None and sizes[name] % world != 0}


def check_strategy_name(shard_strategy: str, allowed: Sequence[str] = SHARD_STRATEGIES) -> None:
    """Raise ValueError unless ``shard_strategy`` is one of ``allowed``."""
    if shard_strategy not in allowed:
        raise ValueError(f"shard_strategy must be one of {tuple(allowed)}, got {shard_strategy!r}")


def check_split(shard_strategy: str, world: int, *, num_heads: int | None = None,
                mlp_hidden: int | None = None) -> None:
    """A layer's construction guard: raise ValueError when ``shard_strategy`` cannot split its sizes over ``world``."""
    bad = indivisible_sizes(shard_strategy, world, num_heads=num_heads, mlp_hidden=mlp_hidden)
    if "num_heads" in bad and shard_strategy == "shard_heads":
        raise ValueError(
            f"shard_strategy='shard_heads' needs num_heads={num_heads} divisible by the group size "
            f"{world}; use a multiple of {world} heads or shard_strategy='shard_sequence'"
        )
    if "num_heads" in bad:
        raise ValueError(
            f"num_heads={num_heads} is not divisible by the tensor-parallel group size {world}: heads are "
            f"split whole over the ranks; use a multiple of {world} heads or a group whose size divides {num_heads}"
        )
    if "mlp_hidden" in bad:
        raise ValueError(
            f"the MLP hidden size mlp_ratio * num_channels = {mlp_hidden} is not divisible by the tensor-parallel "
            f"group size {world}: choose mlp_ratio or num_channels so that it is"
        )
