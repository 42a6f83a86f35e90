"""Training samples from an anemoi-layout dataset: windows of dates, variable roles, a resumable sampler.

A sample is a window of ``multistep_input + rollout`` dates spaced by ``timestep`` (a multiple of
the dataset's frequency): the inputs at ``t - (multistep_input - 1) * timestep, ..., t`` and the
targets at ``t + timestep, ..., t + rollout * timestep``. Its tensor holds every dataset
variable in dataset order:

- ``ensemble="all"``: ``(time, ensemble, cells, variables)``, the dataset's own members (1 for a
  deterministic dataset);
- ``ensemble="each"``: ``(time, cells, variables)``, one member per sample (the sample index runs
  over windows x members).

:func:`split_sample` cuts a sample into model inputs and targets;
:func:`split_by_dates` makes train / validation / test sets from date ranges.

:class:`ResumableSampler` gives a deterministic, seedable order (a permutation per epoch), shards
it over data-parallel ranks and reports/restores its position (``state_dict``).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import torch
from einops import rearrange
from torch import Tensor
from torch.utils.data import Dataset, Sampler

from stormshard.data.anemoi_layout import AnemoiDataset, as_datetime64, frequency_to_string, parse_frequency

__all__ = ["WindowedSampleDataset", "split_sample", "split_by_dates", "date_range_bounds", "overlapping_ranges",
           "ResumableSampler"]


def split_sample(sample: Tensor, multistep_input: int, input_indices: Sequence[int],
                 output_indices: Sequence[int], time_dim: int = 0) -> tuple[Tensor, Tensor]:
    """Cut a sample ``(..., variables)`` along ``time_dim`` into model inputs and targets.

    ``time_dim`` is 0 for a sample from :class:`WindowedSampleDataset` and 1 for a batch of them;
    ``input_indices`` / ``output_indices`` are dataset variable positions (e.g.
    ``stormshard.models.variables.VariableIndex.input_idx``). Returns ``inputs`` (the first ``multistep_input`` times,
    input variables) and ``targets`` (the remaining times, output variables); both are copies.
    """
    times = sample.shape[time_dim]
    if times <= multistep_input:
        raise ValueError(f"sample has {times} times along dim {time_dim}: it needs more than "
                         f"multistep_input={multistep_input}")
    for name, idx in (("input_indices", input_indices), ("output_indices", output_indices)):
        if any(not 0 <= i < sample.shape[-1] for i in idx):
            raise ValueError(f"{name} {list(idx)} point outside the sample's {sample.shape[-1]} variables")
    inputs = sample.narrow(time_dim, 0, multistep_input)[..., list(input_indices)]
    targets = sample.narrow(time_dim, multistep_input, times - multistep_input)[..., list(output_indices)]
    return inputs, targets


def date_range_bounds(dataset: AnemoiDataset, start: Any, end: Any) -> tuple[np.datetime64, np.datetime64]:
    """The inclusive ``(first, last)`` instants of a date range: None = the dataset's ends, an end
    written to a coarser precision covers its whole period (``"2020-12"`` ends 2020-12-31T23:59:59)."""
    lo = dataset.start_date if start is None else as_datetime64(start, "start")
    hi = dataset.end_date if end is None else _end_of(end)
    return lo, hi


def overlapping_ranges(dataset: AnemoiDataset, ranges: Mapping[str, tuple[Any, Any]]) -> list[tuple[str, str]]:
    """Pairs of named ``(start, end)`` ranges that share at least one instant."""
    bounds = {name: date_range_bounds(dataset, *r) for name, r in ranges.items()}
    names = list(bounds)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if bounds[a][0] <= bounds[b][1] and bounds[b][0] <= bounds[a][1]]


def split_by_dates(dataset: AnemoiDataset, ranges: Mapping[str, tuple[Any, Any]],
                   **window_kwargs: Any) -> dict[str, WindowedSampleDataset]:
    """One :class:`WindowedSampleDataset` per named ``(start, end)`` range (inclusive; None = open).

    E.g. ``split_by_dates(ds, {"train": (None, "2020-03-31T18"), "validation": ("2020-04-01", None)},
    multistep_input=2, rollout=1)``. The ranges must not overlap, so no date is in two splits.
    """
    bounds = []
    for name, (start, end) in ranges.items():
        lo = dataset.start_date if start is None else as_datetime64(start, f"{name} start")
        hi = dataset.end_date if end is None else _end_of(end)
        bounds.append((lo, hi, name))
    bounds.sort()
    for (_, hi_a, a), (lo_b, _, b) in zip(bounds, bounds[1:], strict=False):
        if lo_b <= hi_a:
            raise ValueError(f"date ranges {a!r} and {b!r} overlap ({a} ends {hi_a}, {b} starts {lo_b}): "
                             "a date would be in both splits")
    return {name: WindowedSampleDataset(dataset, start=lo, end=hi, **window_kwargs) for lo, hi, name in bounds}


class WindowedSampleDataset(Dataset):
    """Windows of dates from an :class:`AnemoiDataset`, restricted to a date range.

    A window is used when all its dates lie in ``[start, end]`` (inclusive; None = the dataset's
    ends) and none of them is a missing date. A date written to a coarser precision covers its
    whole period, as in anemoi-datasets: ``end="2020"`` or ``"2020-12"`` or ``"2020-12-31"`` all
    include 2020-12-31T18:00. ``timestep`` must be a multiple of the dataset's frequency.
    ``read(index, cells=slice)`` reads only a contiguous slice of the grid.
    """

    def __init__(
        self,
        dataset: AnemoiDataset,
        *,
        multistep_input: int = 1,
        rollout: int = 1,
        timestep: str | int | datetime.timedelta | None = None,
        start: Any = None,
        end: Any = None,
        ensemble: Literal["all", "each"] = "all",
        dtype: torch.dtype = torch.float32,
    ) -> None:
        for name, value in (("multistep_input", multistep_input), ("rollout", rollout)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if ensemble not in ("all", "each"):
            raise ValueError(f"ensemble must be 'all' (samples keep the member dim) or 'each' (one member per "
                             f"sample), got {ensemble!r}")
        step = dataset.frequency if timestep is None else parse_frequency(timestep)
        ratio = step / dataset.frequency
        if ratio != int(ratio):
            raise ValueError(f"timestep {frequency_to_string(step)} is not a multiple of the dataset frequency "
                             f"{frequency_to_string(dataset.frequency)}")
        self.dataset = dataset
        self.multistep_input = multistep_input
        self.rollout = rollout
        self.timestep = step
        self.stride = int(ratio)
        self.ensemble = ensemble
        self.dtype = dtype
        self.offsets = self.stride * np.arange(multistep_input + rollout)

        first = dataset.start_date if start is None else as_datetime64(start, "start")
        last = dataset.end_date if end is None else _end_of(end)
        if last < first:
            raise ValueError(f"end {last} is before start {first}")
        lo = int(np.searchsorted(dataset.dates, first, side="left"))
        hi = int(np.searchsorted(dataset.dates, last, side="right"))  # dates[lo:hi] are in range
        starts = np.arange(lo, max(hi - int(self.offsets[-1]), lo))
        if dataset.missing_dates:
            missing = np.zeros(dataset.num_dates, dtype=bool)
            missing[list(dataset.missing_dates)] = True
            touches = np.zeros(len(starts), dtype=bool)
            for off in self.offsets:
                touches |= missing[starts + off]
            starts = starts[~touches]
        if len(starts) == 0:
            raise ValueError(
                f"no window of {multistep_input} input + {rollout} target dates every {frequency_to_string(step)} "
                f"fits between {first} and {last} (dataset {dataset.start_date} to {dataset.end_date}); widen the "
                "date range or shorten the window"
            )
        self.window_starts = starts
        self.members = dataset.ensemble_size if ensemble == "each" else 1

    # ---------------------------------------------------------------- indexing
    def __len__(self) -> int:
        return len(self.window_starts) * self.members

    def _locate(self, index: int) -> tuple[int, int | None]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample index {index} out of range for {len(self)} samples")
        index %= len(self)
        window, member = divmod(index, self.members)
        return int(self.window_starts[window]), (member if self.ensemble == "each" else None)

    def date_indices(self, index: int) -> np.ndarray:
        """Indices into the dataset's dates of sample ``index``'s window ``(multistep_input + rollout,)``."""
        start, _ = self._locate(index)
        return start + self.offsets

    def dates(self, index: int) -> np.ndarray:
        """The window's dates; the last input date is ``dates[multistep_input - 1]``."""
        return self.dataset.dates[self.date_indices(index)]

    def read(self, index: int, cells: slice | None = None, times: int | None = None) -> Tensor:
        """Sample ``index`` (optionally only ``cells``, and only its first ``times`` dates, e.g.
        ``multistep_input + rollout`` of a shorter rollout): ``(time, ensemble, cells, variables)``
        or, with ``ensemble="each"``, ``(time, cells, variables)``."""
        start, member = self._locate(index)
        if times is not None and not 1 <= times <= len(self.offsets):
            raise ValueError(f"times={times} must lie in [1, {len(self.offsets)}] (the window's dates)")
        offsets = self.offsets if times is None else self.offsets[:times]
        raw = self.dataset.read(start + offsets, cells=cells)  # (time, variables, ensemble, cells)
        if member is not None:
            raw = raw[:, :, member]
            return torch.from_numpy(rearrange(raw, "t v c -> t c v").copy()).to(self.dtype)
        return torch.from_numpy(rearrange(raw, "t v e c -> t e c v").copy()).to(self.dtype)

    def __getitem__(self, index: int) -> Tensor:
        return self.read(index)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        t, ds = len(self.offsets), self.dataset
        if self.ensemble == "each":
            return (t, ds.num_cells, ds.num_variables)
        return (t, ds.ensemble_size, ds.num_cells, ds.num_variables)


def _end_of(value: Any) -> np.datetime64:
    """An inclusive end: the last second of the period ``value`` is written to (an int is a year)."""
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = f"{int(value):04d}"
    if isinstance(value, str):
        try:
            d = np.datetime64(value.strip())
        except ValueError:
            raise ValueError(f"end {value!r} is not a date: give an ISO string such as '2020-03-31T18:00', "
                             "'2020-03' or '2020'") from None
        unit = np.datetime_data(d.dtype)[0]
        if unit in ("Y", "M", "W", "D", "h", "m"):
            return (d + np.timedelta64(1, unit)).astype("datetime64[s]") - np.timedelta64(1, "s")
    return as_datetime64(value, "end")


class ResumableSampler(Sampler[int]):
    """Deterministic sample order, sharded over data-parallel ranks, with a restorable position.

    Epoch ``e`` uses the permutation of ``range(num_samples)`` drawn from ``seed + e`` (or the
    identity with ``shuffle=False``); its first ``len(self) * world_size`` entries are dealt
    round-robin, rank ``r`` taking entries ``r, r + world_size, ...``. With ``drop_last`` the tail
    that does not fill every rank is dropped, otherwise it is padded by wrapping around, so every
    rank gets the same number of samples. ``rank`` / ``world_size`` are data-parallel: all ranks of
    one model group (and so of its reader groups) pass the same rank and see the same samples.

    Position: ``state_dict()`` holds the epoch and how many of this rank's samples were consumed
    (by default, how many the current iterator has yielded; with a prefetching DataLoader pass
    the count the training loop actually used). ``load_state_dict`` makes the next ``__iter__``
    continue from there. Call ``set_epoch`` at the start of every epoch.
    """

    def __init__(self, num_samples: int, *, shuffle: bool = True, seed: int = 0, rank: int = 0,
                 world_size: int = 1, drop_last: bool = True) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be positive, got {num_samples}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, world_size={world_size})")
        if drop_last and num_samples < world_size:
            raise ValueError(f"{num_samples} samples cannot give every one of {world_size} data-parallel ranks one "
                             "sample with drop_last=True; use more samples or drop_last=False")
        self.num_samples, self.shuffle, self.seed = num_samples, shuffle, seed
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.epoch = 0
        self._start = 0  # where the next __iter__ begins
        self._position = 0  # samples of this epoch handed out so far

    def __len__(self) -> int:
        if self.drop_last:
            return self.num_samples // self.world_size
        return -(-self.num_samples // self.world_size)

    def indices(self, epoch: int | None = None) -> list[int]:
        """This rank's full list of sample indices for ``epoch`` (default: the current one)."""
        epoch = self.epoch if epoch is None else epoch
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + epoch)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        total = len(self) * self.world_size
        if total > len(order):
            order = (order * (total // len(order) + 1))[:total]
        return order[:total][self.rank :: self.world_size]

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` from its beginning."""
        self.epoch, self._start, self._position = int(epoch), 0, 0

    def __iter__(self) -> Iterator[int]:
        order = self.indices()
        start = self._start
        self._start, self._position = 0, start  # a resume position applies to one iterator only
        for i in order[start:]:
            self._position += 1
            yield i

    @property
    def position(self) -> int:
        """How many of this rank's samples of the current epoch have been handed out."""
        return self._position

    def state_dict(self, consumed: int | None = None) -> dict[str, int]:
        """``{"epoch", "position", "seed", "num_samples", "world_size", "rank"}``.

        ``consumed``: samples of this rank used in this epoch (overrides the yielded count).
        """
        position = self.position if consumed is None else int(consumed)
        return {"epoch": self.epoch, "position": position, "seed": self.seed, "num_samples": self.num_samples,
                "world_size": self.world_size, "rank": self.rank}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state``: the next ``__iter__`` yields the rest of that epoch."""
        for key in ("seed", "num_samples", "world_size"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"the saved sampler state has {key}={state[key]} but this sampler has "
                                 f"{getattr(self, key)}; resume with the same dataset, seed and data-parallel size")
        position = int(state["position"])
        if not 0 <= position <= len(self):
            raise ValueError(f"saved position {position} is outside this rank's epoch of {len(self)} samples")
        self.epoch, self._start, self._position = int(state["epoch"]), position, position

    def remaining(self) -> Sequence[int]:
        """The indices the next ``__iter__`` will yield."""
        return self.indices()[self._start :]
