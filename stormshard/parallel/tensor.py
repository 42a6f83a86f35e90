"""Tensor-parallel linears (Megatron-style column / row split) with optional sequence parallelism.

Layouts: inputs are ``(..., seq, channels)``; the sequence is dimension ``-2`` and channels ``-1``.
A *tensor-parallel region* is a computation whose channels are split over ``group``; a
*sequence-parallel region* is one whose sequence is split over ``group`` as a
:class:`~stormshard.parallel.shard.SequenceShard` describes it (uneven shards allowed), bound to
the layer at construction.

Region mappings: the autograd collectives of :mod:`stormshard.parallel.comm`, under their anemoi
names (forward / backward; Megatron's name in brackets):

- ``copy_tensor(x, group)`` [copy to the TP region]: identity / all-reduce;
- ``reduce_tensor(x, group)`` [reduce from the TP region]: all-reduce / identity;
- ``shard_tensor(x, -1, ...)`` [scatter to the TP region]: keep this rank's channel slice /
  all-gather the channels;
- ``gather_tensor(x, -1, ...)`` [gather from the TP region]: all-gather the channels / keep this
  rank's channel slice;
- ``sync_tensor(x, -2, shard.sizes, group)`` [gather from the sequence-parallel region]:
  all-gather the sequence / reduce-scatter it;
- ``reduce_shard_tensor(x, -2, shard.sizes, group)`` [reduce-scatter to the sequence-parallel
  region]: reduce-scatter the sequence / all-gather it.

Parameters are sliced evenly: a size that the group size does not divide raises ValueError. Each
sliced parameter carries a :class:`~stormshard.parallel.partition.Partition`. Fresh layers build
the full ``nn.Linear`` from torch's default generator exactly as ``nn.Linear`` does and keep their
slice, so for the same seed every layout holds the same full weights.

Gradients follow the project's convention (:mod:`stormshard.parallel.grads`): a sliced parameter's
gradient is complete after backward. A replicated one (the row-parallel bias) is complete too
without sequence parallelism (every rank computes the same replicated output and loss); with
sequence parallelism it only saw this rank's tokens, so it holds this rank's part and is summed
over the model group after backward (``reduce_model_parallel_gradients``), like the replicated
weights of every sequence-sharded layer.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from stormshard.parallel.comm import (
    all_gather_along,
    copy_tensor,
    gather_tensor,
    reduce_shard_tensor,
    reduce_tensor,
    shard_tensor,
    sync_tensor,
)
from stormshard.parallel.partition import Partition, get_partition, set_partition
from stormshard.parallel.shapes import group_rank, group_size
from stormshard.parallel.shard import SequenceShard
from stormshard.parallel.te_backend import LocalLinear, resolve_use_te

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "divide",
    "slice_partition",
    "gather_partition",
    "full_state_dict",
    "load_full_state_dict",
]

ProcessGroup = dist.ProcessGroup

SEQ_DIM = -2


# --------------------------------------------------------------------------------------------
# sizes
# --------------------------------------------------------------------------------------------


def divide(size: int, group: ProcessGroup | None, name: str) -> int:
    """``size / group_size(group)``; ValueError naming ``name``, the size and the group size if uneven."""
    parts = group_size(group)
    if size % parts != 0:
        raise ValueError(
            f"{name}={size} is not divisible by the tensor-parallel group size {parts}: choose {name} "
            f"a multiple of {parts}, or a group whose size divides {size}"
        )
    return size // parts


# --------------------------------------------------------------------------------------------
# partitioned parameters
# --------------------------------------------------------------------------------------------


def slice_partition(full: Tensor, partition: Partition) -> Tensor:
    """This rank's slice (a new tensor) of ``full`` as ``partition`` describes it; no communication."""
    if full.shape[partition.dim] != partition.full_size:
        raise ValueError(
            f"cannot slice a tensor of shape {tuple(full.shape)} for {partition}: dimension "
            f"{partition.dim} should have size {partition.full_size}"
        )
    return full.detach().narrow(partition.dim, partition.offset, partition.sizes[partition.index]).clone()


def gather_partition(param: Tensor, group: ProcessGroup | None) -> Tensor:
    """The full tensor ``param`` is a slice of (all-gather along its partition), or a copy if replicated."""
    part = get_partition(param)
    data = param.detach()
    if part is None:
        return data.clone()
    if part.parts != group_size(group):
        raise ValueError(f"parameter is split in {part.parts} parts but the group has {group_size(group)} ranks")
    return all_gather_along(data.contiguous(), part.dim, part.sizes, group).clone()


def full_state_dict(module: nn.Module, group: ProcessGroup | None) -> dict[str, Tensor]:
    """``module``'s state dict with every partitioned parameter gathered to its full shape.

    The keys and full shapes equal those of the single-process module. Communicates one
    all-gather per partitioned parameter.
    """
    return {name: gather_partition(value, group) for name, value in module.state_dict(keep_vars=True).items()}


def load_full_state_dict(module: nn.Module, state_dict: Mapping[str, Tensor]) -> None:
    """Copy full (single-process) tensors into ``module``, slicing partitioned ones; no communication."""
    own = module.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(state_dict)), sorted(set(state_dict) - set(own))
    if missing or unexpected:
        raise ValueError(f"state_dict does not match the module: missing keys {missing}, unexpected keys {unexpected}")
    with torch.no_grad():
        for name, target in own.items():
            part = get_partition(target)
            source = state_dict[name] if part is None else slice_partition(state_dict[name], part)
            if source.shape != target.shape:
                raise ValueError(f"{name}: shape {tuple(source.shape)} does not fit {tuple(target.shape)}")
            target.copy_(source)


# --------------------------------------------------------------------------------------------
# layers
# --------------------------------------------------------------------------------------------


def _check_features(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be positive, got {value}")
    return value


def _check_flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def _resolve_group(group: ProcessGroup | None, sequence_shard: SequenceShard | None) -> ProcessGroup | None:
    """The tensor-parallel group: ``group``, or ``sequence_shard.group`` when ``group`` is None.

    With sequence parallelism the sequence is split over the same ranks as the channels, so the
    shard must be over ``group`` (checked once, here).
    """
    if sequence_shard is not None and not isinstance(sequence_shard, SequenceShard):
        raise TypeError(f"sequence_shard must be a SequenceShard or None, got {type(sequence_shard).__name__}")
    if sequence_shard is None:
        return group
    if group is None or group is sequence_shard.group:
        return sequence_shard.group
    if group_size(group) == 1 and sequence_shard.world == 1:
        return group
    raise ValueError(
        f"sequence_shard is split over a different process group ({sequence_shard.world} ranks) than the "
        f"tensor-parallel group ({group_size(group)} ranks): build the SequenceShard over the same group, or "
        "pass group=None to use the shard's"
    )


class _ParallelLinear(nn.Module):
    """Shared set-up: slice a full ``nn.Linear`` along ``split_dim`` of its weight (0 rows, 1 columns)."""

    split_dim: int
    sequence_shard: SequenceShard | None

    def _setup(self, full: nn.Linear, group: ProcessGroup | None, use_te: bool | None) -> None:
        self.in_features, self.out_features = full.in_features, full.out_features
        self.group = group
        self.parts, self.rank = group_size(group), group_rank(group)
        self._local = LocalLinear(resolve_use_te(use_te))
        name = "out_features" if self.split_dim == 0 else "in_features"
        divide(full.weight.shape[self.split_dim], group, name)
        part = Partition(self.split_dim, self.parts, self.rank, full.weight.shape[self.split_dim])
        self.weight = nn.Parameter(slice_partition(full.weight, part))
        set_partition(self.weight, part)
        if full.bias is None:
            self.register_parameter("bias", None)
        elif self.split_dim == 0:
            bias_part = Partition(0, self.parts, self.rank, full.out_features)
            self.bias = nn.Parameter(slice_partition(full.bias, bias_part))
            set_partition(self.bias, bias_part)
        else:
            self.bias = nn.Parameter(full.bias.detach().clone())

    @property
    def sequence_parallel(self) -> bool:
        """True when the sequence side of this layer is sharded (``sequence_shard`` given)."""
        return self.sequence_shard is not None

    def to_linear(self) -> nn.Linear:
        """The full ``nn.Linear`` on every rank (all-gathers the weight and bias slices)."""
        weight = gather_partition(self.weight, self.group)
        linear = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
        linear.weight = nn.Parameter(weight)
        if self.bias is not None:
            linear.bias = nn.Parameter(gather_partition(self.bias, self.group))
        return linear

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"parts={self.parts}, rank={self.rank}, sequence_parallel={self.sequence_parallel}")


class ColumnParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with the output features (rows of ``W`` and ``b``) split over ``group``.

    Input ``x (..., seq, in_features)``: replicated over the group, or, with a ``sequence_shard``
    (sequence parallelism, bound at construction), this rank's ``sequence_shard.local_size``
    tokens, all-gathered along ``seq`` (backward reduce-scatters). Output
    ``(..., seq, out_features / p)``, or ``(..., seq, out_features)`` replicated with
    ``gather_output`` (an all-gather of the channels). Without sequence parallelism the input
    gradient is all-reduced (``copy_tensor``). ``group`` None with a ``sequence_shard`` means the
    shard's group.
    """

    split_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group: ProcessGroup | None = None,
        gather_output: bool = False,
        sequence_shard: SequenceShard | None = None,
        *,
        use_te: bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        _check_features("in_features", in_features)
        group = _resolve_group(group, sequence_shard)
        divide(_check_features("out_features", out_features), group, "out_features")
        self.gather_output = _check_flag("gather_output", gather_output)
        self.sequence_shard = sequence_shard
        resolve_use_te(use_te)
        full = nn.Linear(in_features, out_features, bias=_check_flag("bias", bias), device=device, dtype=dtype)
        self._setup(full, group, use_te)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group: ProcessGroup | None = None, gather_output: bool = False,
        sequence_shard: SequenceShard | None = None, *, use_te: bool | None = None,
    ) -> ColumnParallelLinear:
        """This rank's column-parallel slice of the full ``linear`` (no communication)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        group = _resolve_group(group, sequence_shard)
        divide(linear.out_features, group, "out_features")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.gather_output = _check_flag("gather_output", gather_output)
        layer.sequence_shard = sequence_shard
        layer._setup(linear, group, use_te)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        """``x (..., seq[_local], in)`` -> ``(..., seq, out/p)`` (or ``out`` with gather_output)."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"input has {x.shape[-1]} channels but in_features={self.in_features}")
        if self.sequence_shard is not None:  # all-gather the sequence; backward reduce-scatters it
            if x.dim() < 2:
                raise ValueError(
                    f"sequence parallelism needs an input (..., seq, channels), got shape {tuple(x.shape)}"
                )
            self.sequence_shard.check_local(x, SEQ_DIM, "the sequence-parallel input")
            x = sync_tensor(x, SEQ_DIM, self.sequence_shard.sizes, self.group)
        else:  # identity; backward all-reduces the input gradient
            x = copy_tensor(x, self.group)
        y = self._local(x, self.weight, self.bias)
        if self.gather_output:  # all-gather the channel slices; backward keeps this rank's
            y = gather_tensor(y, -1, [y.shape[-1]] * self.parts, self.group)
        return y


class RowParallelLinear(_ParallelLinear):
    """``y = x W^T + b`` with the input features (columns of ``W``) split over ``group``.

    Input ``x (..., seq, in_features / p)`` (``input_is_parallel``), or replicated
    ``(..., seq, in_features)`` of which this rank keeps its channel slice. The partial products
    are summed over the group: all-reduced (output replicated ``(..., seq, out)``), or with a
    ``sequence_shard`` (sequence parallelism, bound at construction) reduce-scattered along
    ``seq`` (output this rank's ``(..., sequence_shard.local_size, out)``). The bias is replicated
    and added after the sum. ``group`` None with a ``sequence_shard`` means the shard's group.
    """

    split_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        group: ProcessGroup | None = None,
        input_is_parallel: bool = True,
        sequence_shard: SequenceShard | None = None,
        *,
        use_te: bool | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        group = _resolve_group(group, sequence_shard)
        divide(_check_features("in_features", in_features), group, "in_features")
        _check_features("out_features", out_features)
        self.input_is_parallel = _check_flag("input_is_parallel", input_is_parallel)
        self.sequence_shard = sequence_shard
        resolve_use_te(use_te)
        full = nn.Linear(in_features, out_features, bias=_check_flag("bias", bias), device=device, dtype=dtype)
        self._setup(full, group, use_te)

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, group: ProcessGroup | None = None, input_is_parallel: bool = True,
        sequence_shard: SequenceShard | None = None, *, use_te: bool | None = None,
    ) -> RowParallelLinear:
        """This rank's row-parallel slice of the full ``linear`` (no communication)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"linear must be a torch.nn.Linear, got {type(linear).__name__}")
        group = _resolve_group(group, sequence_shard)
        divide(linear.in_features, group, "in_features")
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        layer.input_is_parallel = _check_flag("input_is_parallel", input_is_parallel)
        layer.sequence_shard = sequence_shard
        layer._setup(linear, group, use_te)
        return layer

    def forward(self, x: Tensor) -> Tensor:
        """``x (..., seq, in/p)`` (or ``in`` if not input_is_parallel) -> ``(..., seq[_local], out)``."""
        expected = self.weight.shape[1] if self.input_is_parallel else self.in_features
        if x.shape[-1] != expected:
            raise ValueError(
                f"input has {x.shape[-1]} channels but this rank expects {expected} "
                f"(in_features={self.in_features}, input_is_parallel={self.input_is_parallel})"
            )
        if not self.input_is_parallel:  # keep this rank's channel slice; backward all-gathers them
            local = divide(x.shape[-1], self.group, "channels of the input")
            x = shard_tensor(x, -1, [local] * self.parts, self.group)
        y = self._local(x, self.weight, None)
        if self.sequence_shard is not None:  # sum the partial products, keep this rank's tokens
            shard = self.sequence_shard
            if y.dim() < 2 or y.shape[SEQ_DIM] != shard.length:
                raise ValueError(
                    f"reduce-scatter input has shape {tuple(y.shape)} but the sequence shard {list(shard.sizes)} "
                    f"sums to {shard.length} tokens along dimension -2"
                )
            y = reduce_shard_tensor(y, SEQ_DIM, shard.sizes, self.group)
        else:  # sum the partial products; backward passes the gradient through
            y = reduce_tensor(y, self.group)
        if self.bias is not None:
            y = y + self.bias
        return y
