"""Named random-generator states for dropout (and other sampling) inside parallel regions.

Inside a tensor-parallel region each rank holds a *different* slice of the activations (a group of
heads, a slice of the MLP hidden channels, or, under sequence parallelism, a shard of the tokens):
their dropout masks must be independent, so each rank draws from a stream seeded with its rank.
On replicated activations every rank holds the *same* values and must draw the *same* mask, so the
stream is seeded identically on every rank. A :class:`RNGStatesTracker` keeps one generator state
per named region and swaps it into torch's default generator of its device for the duration of
``with tracker.fork(name):``, saving the advanced state on exit and restoring the default one, so
code outside the fork (and the data-parallel seed) is unaffected::

    tracker = tensor_parallel_rng_tracker(seed=1234, group=model_group, device=x.device)
    with tracker.fork(TENSOR_PARALLEL_REGION):   # differs between ranks of the group
        hidden = F.dropout(hidden, p, training=True)
    with tracker.fork(REPLICATED_REGION):        # agrees between ranks of the group
        out = F.dropout(out, p, training=True)
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from stormshard.parallel.shapes import group_rank

__all__ = [
    "RNGStatesTracker",
    "TrackedDropout",
    "tensor_parallel_rng_tracker",
    "TENSOR_PARALLEL_REGION",
    "REPLICATED_REGION",
]

TENSOR_PARALLEL_REGION = "tensor_parallel"
REPLICATED_REGION = "replicated"
_SEED_OFFSET = 2718


class RNGStatesTracker:
    """One generator state per named region, forked in and out of ``device``'s default generator.

    ``device`` is the device whose default generator ``fork`` swaps ("cpu", "cuda", "cuda:1", ...);
    pass the device of the tensors you sample on.
    """

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._states: dict[str, Tensor] = {}
        self._seeds: dict[str, int] = {}
        self._forked: set[str] = set()

    # -- the device's default generator ------------------------------------------------------

    def _get(self) -> Tensor:
        if self.device.type == "cpu":
            return torch.get_rng_state()
        return torch.get_device_module(self.device.type).get_rng_state(self.device)

    def _set(self, state: Tensor) -> None:
        if self.device.type == "cpu":
            torch.set_rng_state(state)
        else:
            torch.get_device_module(self.device.type).set_rng_state(state, self.device)

    # -- regions --------------------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return list(self._states)

    def seed(self, name: str) -> int:
        """The seed region ``name`` was added with."""
        self._check_name(name)
        return self._seeds[name]

    def add(self, name: str, seed: int) -> None:
        """Add region ``name`` whose stream starts from ``seed``; the default generator is untouched."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"region name must be a non-empty string, got {name!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed of region {name!r} must be an int, got {seed!r}")
        if name in self._states:
            raise ValueError(f"region {name!r} already exists (seed {self._seeds[name]}): use another name or reset()")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self._states[name] = generator.get_state()
        self._seeds[name] = seed

    def reset(self) -> None:
        """Forget every region."""
        self._states.clear()
        self._seeds.clear()

    def get_states(self) -> dict[str, Tensor]:
        """A copy of every region's current state (for checkpoints)."""
        return {name: state.clone() for name, state in self._states.items()}

    def set_states(self, states: Mapping[str, Tensor]) -> None:
        """Restore region states saved by :meth:`get_states` (regions must already exist)."""
        unknown = sorted(set(states) - set(self._states))
        if unknown:
            raise ValueError(f"unknown regions {unknown}: add() them first (known: {self.names})")
        for name, state in states.items():
            self._states[name] = state.clone()

    def _check_name(self, name: str) -> None:
        if name not in self._states:
            raise ValueError(f"no region named {name!r}: add it with tracker.add(name, seed) (known: {self.names})")

    @contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_REGION) -> Iterator[None]:
        """Sample from region ``name``'s stream inside the block; advance it; restore the default stream."""
        self._check_name(name)
        if name in self._forked:
            raise RuntimeError(f"region {name!r} is already forked: nested forks of one region would lose draws")
        outer = self._get()
        self._set(self._states[name])
        self._forked.add(name)
        try:
            yield
        finally:
            self._states[name] = self._get()
            self._set(outer)
            self._forked.discard(name)


def tensor_parallel_rng_tracker(
    seed: int, group: dist.ProcessGroup | None, device: torch.device | str = "cpu"
) -> RNGStatesTracker:
    """A tracker with the two regions of a tensor-parallel model group.

    - ``TENSOR_PARALLEL_REGION``: seeded ``seed + 2718 + 1 + rank`` (rank in ``group``): ranks differ;
    - ``REPLICATED_REGION``: seeded ``seed + 2718`` on every rank: ranks agree.

    Pass the same ``seed`` on every rank of ``group``.
    """
    tracker = RNGStatesTracker(device)
    tracker.add(REPLICATED_REGION, seed + _SEED_OFFSET)
    tracker.add(TENSOR_PARALLEL_REGION, seed + _SEED_OFFSET + 1 + group_rank(group))
    return tracker


class TrackedDropout(nn.Module):
    """Dropout drawing its mask from region ``region`` of ``tracker`` (layout unchanged)."""

    def __init__(self, p: float, tracker: RNGStatesTracker, region: str = TENSOR_PARALLEL_REGION) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability p must be in [0, 1), got {p}")
        tracker._check_name(region)
        self.p, self.tracker, self.region = p, tracker, region

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.tracker.fork(self.region):
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        return f"p={self.p}, region={self.region!r}"
