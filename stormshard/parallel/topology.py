"""The parallel layout: which ranks shard one model, which hold replicas, who reads together.

Ranks are laid out model-group-fastest (as Megatron orders tensor parallelism first, so that a
model group stays on one node):

- model-communication group: ``gpus_per_model`` consecutive ranks that shard one model instance;
- data-parallel group: the ranks at the same position in every model group (gradients are
  reduced over it);
- reader group: ``read_group_size`` consecutive ranks of a model group that read one sample
  together, each a slice of the grid;
- ensemble group: ``gpus_per_ensemble`` consecutive ranks (whole model groups) that share one
  initial state and spread the ensemble members;
- ensemble data-parallel group: the ranks at the same position in every ensemble group;
- ensemble member group: the ranks of one ensemble group at the same position in their model
  groups (they hold the same grid slice of different members: the CRPS gathers over it).

:class:`ParallelLayout` is pure arithmetic (validated, no process groups); :class:`ProcessGroups`
builds the groups for one rank and also answers DeepSpeed's ``mpu`` interface.

Worked example (anemoi's docs): 2 nodes x 4 GPUs, ``gpus_per_model=2``, micro batch 4 -> each
model sharded over 2 ranks, data over 4, effective batch 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["LayoutError", "ParallelLayout", "BatchPlan", "batch_arithmetic", "ProcessGroups", "build_process_groups",
           "rank_device", "collective_device"]


def rank_device() -> torch.device:
    """This rank's compute device: its current CUDA device where CUDA is available (the launch sets it per
    local rank), else the CPU."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where ``group``'s backend takes tensors: this rank's CUDA device for NCCL, the CPU for gloo."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" \
        else torch.device("cpu")


class LayoutError(ValueError):
    """A parallel layout that cannot be built; the message names the values and the fix."""


def _positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise LayoutError(f"{name} must be a positive integer, got {value!r}")


@dataclass(frozen=True)
class ParallelLayout:
    """Sizes of the parallel layout, validated on construction.

    ``tensor_model_parallel_size`` / ``pipeline_model_parallel_size`` are BioNeMo/Megatron-style
    aliases: the model group is where tensor parallelism runs, so ``gpus_per_model`` equals
    ``tensor x pipeline`` when they are given; pipeline parallelism is not supported (must be 1).
    """

    world_size: int
    gpus_per_model: int = 1
    read_group_size: int = 1
    gpus_per_ensemble: int | None = None
    tensor_model_parallel_size: int | None = None
    pipeline_model_parallel_size: int = 1

    def __post_init__(self) -> None:
        _positive("world_size", self.world_size)
        _positive("gpus_per_model", self.gpus_per_model)
        _positive("read_group_size", self.read_group_size)
        _positive("pipeline_model_parallel_size", self.pipeline_model_parallel_size)
        if self.pipeline_model_parallel_size != 1:
            raise LayoutError(
                f"pipeline_model_parallel_size={self.pipeline_model_parallel_size} is not supported: "
                "stormshard shards models by sequence, tensor and graph parallelism; set it to 1 and "
                "raise gpus_per_model instead"
            )
        if self.tensor_model_parallel_size is not None:
            _positive("tensor_model_parallel_size", self.tensor_model_parallel_size)
            if self.tensor_model_parallel_size * self.pipeline_model_parallel_size != self.gpus_per_model:
                raise LayoutError(
                    f"tensor_model_parallel_size={self.tensor_model_parallel_size} x "
                    f"pipeline_model_parallel_size={self.pipeline_model_parallel_size} must equal "
                    f"gpus_per_model={self.gpus_per_model}: give only one of them, or make them agree"
                )
        if self.world_size % self.gpus_per_model:
            raise LayoutError(
                f"world_size={self.world_size} is not a multiple of gpus_per_model={self.gpus_per_model}: "
                f"launch a multiple of {self.gpus_per_model} processes or choose gpus_per_model dividing "
                f"{self.world_size} (one of {_divisors(self.world_size)})"
            )
        if self.gpus_per_model % self.read_group_size:
            raise LayoutError(
                f"read_group_size={self.read_group_size} does not divide gpus_per_model={self.gpus_per_model}: "
                f"choose one of {_divisors(self.gpus_per_model)} (gpus_per_model reads fastest)"
            )
        ens = self.ensemble_size
        _positive("gpus_per_ensemble", ens)
        if ens % self.gpus_per_model:
            raise LayoutError(
                f"gpus_per_ensemble={ens} is not a multiple of gpus_per_model={self.gpus_per_model}: "
                "an ensemble group holds whole model groups; choose a multiple of gpus_per_model"
            )
        if self.world_size % ens:
            raise LayoutError(
                f"gpus_per_ensemble={ens} does not divide world_size={self.world_size}: "
                f"choose one of {[d for d in _divisors(self.world_size) if d % self.gpus_per_model == 0]}"
            )

    # ---- derived sizes ----------------------------------------------------------------------
    @property
    def ensemble_size(self) -> int:
        """Ranks per ensemble group (``gpus_per_ensemble``, defaulting to ``gpus_per_model``)."""
        return self.gpus_per_model if self.gpus_per_ensemble is None else self.gpus_per_ensemble

    @property
    def model_parallel_size(self) -> int:
        return self.gpus_per_model

    @property
    def data_parallel_size(self) -> int:
        """Number of model replicas: world / gpus_per_model."""
        return self.world_size // self.gpus_per_model

    @property
    def num_ensemble_groups(self) -> int:
        return self.world_size // self.ensemble_size

    # ---- rank lists -------------------------------------------------------------------------
    def model_groups(self) -> list[list[int]]:
        k = self.gpus_per_model
        return [list(range(i * k, (i + 1) * k)) for i in range(self.data_parallel_size)]

    def data_parallel_groups(self) -> list[list[int]]:
        k = self.gpus_per_model
        return [list(range(p, self.world_size, k)) for p in range(k)]

    def reader_groups(self) -> list[list[int]]:
        r = self.read_group_size
        return [list(range(i * r, (i + 1) * r)) for i in range(self.world_size // r)]

    def ensemble_groups(self) -> list[list[int]]:
        e = self.ensemble_size
        return [list(range(i * e, (i + 1) * e)) for i in range(self.num_ensemble_groups)]

    def ensemble_data_parallel_groups(self) -> list[list[int]]:
        e = self.ensemble_size
        return [list(range(p, self.world_size, e)) for p in range(e)]

    def ensemble_member_groups(self) -> list[list[int]]:
        k, e = self.gpus_per_model, self.ensemble_size
        return [list(range(start + p, start + e, k)) for start in range(0, self.world_size, e) for p in range(k)]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise LayoutError(f"rank {rank} is outside a world of {self.world_size} ranks")

    def model_group_ranks(self, rank: int) -> list[int]:
        self._check_rank(rank)
        return self.model_groups()[rank // self.gpus_per_model]

    def data_parallel_group_ranks(self, rank: int) -> list[int]:
        self._check_rank(rank)
        return self.data_parallel_groups()[rank % self.gpus_per_model]

    def reader_group_ranks(self, rank: int) -> list[int]:
        self._check_rank(rank)
        return self.reader_groups()[rank // self.read_group_size]

    def ensemble_group_ranks(self, rank: int) -> list[int]:
        self._check_rank(rank)
        return self.ensemble_groups()[rank // self.ensemble_size]

    def ensemble_data_parallel_group_ranks(self, rank: int) -> list[int]:
        self._check_rank(rank)
        return self.ensemble_data_parallel_groups()[rank % self.ensemble_size]

    def ensemble_member_group_ranks(self, rank: int) -> list[int]:
        self._check_rank(rank)
        return next(g for g in self.ensemble_member_groups() if rank in g)

    def describe(self) -> str:
        return (
            f"world {self.world_size} | gpus_per_model {self.gpus_per_model} | data-parallel "
            f"{self.data_parallel_size} | read_group_size {self.read_group_size} | gpus_per_ensemble "
            f"{self.ensemble_size} ({self.num_ensemble_groups} ensemble groups)"
        )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class BatchPlan:
    """The global-batch arithmetic of one training step."""

    micro_batch: int
    accumulation: int
    world_size: int
    model_parallel_size: int
    data_parallel_size: int
    effective_batch: int

    def describe(self) -> str:
        return (
            f"micro batch {self.micro_batch} x world {self.world_size} x accumulation {self.accumulation} "
            f"/ model-parallel {self.model_parallel_size} = effective batch {self.effective_batch} "
            f"(data-parallel size {self.data_parallel_size})"
        )


def batch_arithmetic(
    micro_batch: int,
    world_size: int,
    accumulation: int = 1,
    gpus_per_model: int = 1,
    tensor_model_parallel_size: int | None = None,
    pipeline_model_parallel_size: int = 1,
) -> BatchPlan:
    """Effective (global) batch = micro batch x world size x accumulation / model-parallel size.

    The model-parallel size is ``gpus_per_model``, or ``tensor x pipeline`` when those are given
    (BioNeMo's formula; pipeline must be 1); the sizes are checked by :class:`ParallelLayout` (the one place of the
    layout rules: the world must be a multiple of the model group).
    """
    _positive("micro_batch", micro_batch)
    _positive("accumulation", accumulation)
    if tensor_model_parallel_size is not None and gpus_per_model == 1:
        _positive("tensor_model_parallel_size", tensor_model_parallel_size)
        _positive("pipeline_model_parallel_size", pipeline_model_parallel_size)
        gpus_per_model = tensor_model_parallel_size * pipeline_model_parallel_size
    layout = ParallelLayout(world_size, gpus_per_model, tensor_model_parallel_size=tensor_model_parallel_size,
                            pipeline_model_parallel_size=pipeline_model_parallel_size)
    data_parallel = layout.data_parallel_size
    return BatchPlan(micro_batch, accumulation, world_size, layout.gpus_per_model, data_parallel,
                     micro_batch * data_parallel * accumulation)


class ProcessGroups:
    """The process groups of one rank for a :class:`ParallelLayout`; also DeepSpeed's ``mpu``.

    Build with :func:`build_process_groups` on every rank (``dist.new_group`` must be called by
    all ranks in the same order). With a world of one process and no initialised
    ``torch.distributed``, every group is None (the collectives treat None as a 1-rank group).
    """

    def __init__(self, layout: ParallelLayout, rank: int, groups: dict[str, object]) -> None:
        self.layout = layout
        self.rank = rank
        self.model_group = groups.get("model")
        self.data_parallel_group = groups.get("data_parallel")
        self.reader_group = groups.get("reader")
        self.ensemble_group = groups.get("ensemble")
        self.ensemble_data_parallel_group = groups.get("ensemble_data_parallel")
        self.ensemble_member_group = groups.get("ensemble_member")

    # ---- ranks and sizes --------------------------------------------------------------------
    @property
    def model_group_ranks(self) -> list[int]:
        return self.layout.model_group_ranks(self.rank)

    @property
    def data_parallel_group_ranks(self) -> list[int]:
        return self.layout.data_parallel_group_ranks(self.rank)

    @property
    def reader_group_ranks(self) -> list[int]:
        return self.layout.reader_group_ranks(self.rank)

    @property
    def ensemble_group_ranks(self) -> list[int]:
        return self.layout.ensemble_group_ranks(self.rank)

    @property
    def ensemble_member_group_ranks(self) -> list[int]:
        return self.layout.ensemble_member_group_ranks(self.rank)

    @property
    def ensemble_member_rank(self) -> int:
        """Which model group of its ensemble group this rank belongs to."""
        return self.ensemble_rank // self.layout.gpus_per_model

    @property
    def model_rank(self) -> int:
        """Position of this rank in its model group."""
        return self.rank % self.layout.gpus_per_model

    @property
    def data_parallel_rank(self) -> int:
        """Which model replica this rank belongs to."""
        return self.rank // self.layout.gpus_per_model

    @property
    def reader_rank(self) -> int:
        return self.rank % self.layout.read_group_size

    @property
    def ensemble_rank(self) -> int:
        return self.rank % self.layout.ensemble_size

    @property
    def ensemble_data_parallel_rank(self) -> int:
        """Which initial state (ensemble group) this rank works on."""
        return self.rank // self.layout.ensemble_size

    # ---- DeepSpeed / Megatron mpu interface -------------------------------------------------
    def get_model_parallel_rank(self) -> int:
        return self.model_rank

    def get_model_parallel_world_size(self) -> int:
        return self.layout.gpus_per_model

    def get_model_parallel_group(self):  # noqa: ANN201
        return self.model_group

    def get_data_parallel_rank(self) -> int:
        return self.data_parallel_rank

    def get_data_parallel_world_size(self) -> int:
        return self.layout.data_parallel_size

    def get_data_parallel_group(self):  # noqa: ANN201
        return self.data_parallel_group

    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size
    get_tensor_model_parallel_group = get_model_parallel_group

    def get_pipeline_model_parallel_rank(self) -> int:
        return 0

    def get_pipeline_model_parallel_world_size(self) -> int:
        return 1

    def get_pipeline_model_parallel_group(self):  # noqa: ANN201
        return None

    def __repr__(self) -> str:
        return f"ProcessGroups(rank={self.rank}, {self.layout.describe()})"


def build_process_groups(layout: ParallelLayout, rank: int | None = None) -> ProcessGroups:
    """Create every group of ``layout`` (collectively, on all ranks) and return this rank's.

    The layout is validated before anything is created; the world size must match the
    initialised default group.
    """
    if not dist.is_initialized():
        if layout.world_size != 1:
            raise LayoutError(
                f"torch.distributed is not initialised but the layout has world_size={layout.world_size}: "
                "call torch.distributed.init_process_group first (or use world_size=1)"
            )
        return ProcessGroups(layout, 0, {})
    world = dist.get_world_size()
    if world != layout.world_size:
        raise LayoutError(
            f"the layout is for world_size={layout.world_size} but {world} processes were launched: "
            f"launch {layout.world_size} processes or rebuild the layout with world_size={world}"
        )
    rank = dist.get_rank() if rank is None else rank
    families = {
        "model": layout.model_groups(),
        "data_parallel": layout.data_parallel_groups(),
        "reader": layout.reader_groups(),
        "ensemble": layout.ensemble_groups(),
        "ensemble_data_parallel": layout.ensemble_data_parallel_groups(),
        "ensemble_member": layout.ensemble_member_groups(),
    }
    mine: dict[str, object] = {}
    cache: dict[tuple[int, ...], object] = {}
    for name, family in families.items():
        for ranks in family:
            key = tuple(ranks)
            if key not in cache:
                cache[key] = dist.group.WORLD if len(ranks) == world else dist.new_group(ranks)
            if rank in ranks:
                mine[name] = cache[key]
    return ProcessGroups(layout, rank, mine)
