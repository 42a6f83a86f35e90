"""Selective checkpointing without a dispatch mode: stormshard's kernels keep their own outputs.

Torch's selective checkpointing watches every operator of a checkpointed block through a Python dispatch mode,
in the forward and again in the recompute: tens of microseconds of Python per operator, about 0.05 s a step for
8 eager transformer layers on a CPU. A block whose only attention operators are stormshard's kernels needs none
of that: :class:`KeptOutputs` is one checkpoint call's store, and while the call's forward runs under
:meth:`KeptOutputs.recording` each eager kernel call puts its outputs (the attention output and the statistics
its backward reads) in the store; the recompute runs under :meth:`KeptOutputs.replaying`, where the same calls,
in the same order, take their outputs back instead of computing them. Every other operator runs with no
watcher at all. :class:`~stormshard.layers.checkpointing.ActivationCheckpoint` chooses it for eager calls of
blocks that run nothing else worth keeping (its first call, watched by torch's mode, tells).

The kernels' eager paths call :func:`kept_or_computed`; nothing else needs to know. A replayed call checks
that its inputs have the recorded shapes and dtypes and that nothing wrote to the kept outputs since (their
version counters): otherwise it computes afresh, which is always right. The store holds detached tensors
that share the outputs' storage, and lets go of each when the recompute takes it (from then on the
recomputed autograd node holds it until its backward has run): the memory torch's selective checkpointing
keeps, for as long. A second backward through a retained graph computes the outputs afresh (torch's
selective checkpointing refuses it).

Nothing is communicated here.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["KeptOutputs", "kept_or_computed", "keeping_outputs"]


@dataclass(frozen=True)
class _Entry:
    """One kernel call's outputs (detached), with what identifies the call and guards the outputs."""

    signature: tuple[tuple[tuple[int, ...], torch.dtype], ...]
    outputs: tuple[Tensor, ...]
    versions: tuple[int, ...]


class _Phase:
    """A context manager that makes a store the thread's active one, recording or replaying; reusable (a
    second backward through a retained graph starts again from the first call)."""

    def __init__(self, store: KeptOutputs, replay: bool) -> None:
        self.store, self.replay = store, replay

    def __enter__(self) -> _Phase:
        stack = _stack()
        stack.append((self.store, self.replay))
        if self.replay:
            self.store.position = 0
        return self

    def __exit__(self, *exc: object) -> None:
        _stack().pop()


class KeptOutputs:
    """The kernel outputs of one checkpointed call of a block, in call order.

    ``recording()``: the context of the checkpointed forward (kernels append); ``replaying()``: the context of
    its recompute (kernels take them back in order). ``(recording(), replaying())`` is what
    :func:`torch.utils.checkpoint.checkpoint` takes from its ``context_fn``."""

    def __init__(self) -> None:
        self.entries: list[_Entry | None] = []
        self.position = 0

    def recording(self) -> _Phase:
        return _Phase(self, replay=False)

    def replaying(self) -> _Phase:
        return _Phase(self, replay=True)

    def contexts(self) -> tuple[_Phase, _Phase]:
        return self.recording(), self.replaying()


def keeping_outputs() -> tuple[_Phase, _Phase]:
    """``context_fn`` of :func:`torch.utils.checkpoint.checkpoint`: a new store's two contexts per call."""
    return KeptOutputs().contexts()


_LOCAL = threading.local()  # the backward's recompute may run on autograd's device thread: one stack per thread


def _stack() -> list[tuple[KeptOutputs, bool]]:
    stack = getattr(_LOCAL, "stack", None)
    if stack is None:
        stack = _LOCAL.stack = []
    return stack


def _signature(inputs: tuple[Tensor, ...]) -> tuple[tuple[tuple[int, ...], torch.dtype], ...]:
    return tuple((tuple(t.shape), t.dtype) for t in inputs)


def kept_or_computed(compute: Callable[[], tuple[Tensor, ...]], *inputs: Tensor) -> tuple[Tensor, ...]:
    """``compute()`` (a kernel's forward: a tuple of output tensors), kept or replayed as the active store asks.

    No store active: ``compute()``. Recording: ``compute()``, its outputs kept (detached). Replaying: the kept
    outputs of the call at this position (detached again), when ``inputs`` have the recorded shapes and dtypes
    and no kept output was written to since; otherwise ``compute()``."""
    stack = getattr(_LOCAL, "stack", None)
    if not stack:
        return compute()
    store, replay = stack[-1]
    if not replay:
        outputs = compute()
        kept = tuple(t.detach() for t in outputs)
        store.entries.append(_Entry(_signature(inputs), kept, tuple(t._version for t in kept)))
        return outputs
    position = store.position
    store.position += 1
    entry = store.entries[position] if position < len(store.entries) else None
    if entry is None:  # past the recorded calls, or taken by an earlier backward (a retained graph)
        return compute()
    store.entries[position] = None  # taken: from here on the recomputed autograd node alone holds the outputs
    if (entry.signature == _signature(inputs)
            and all(t._version == v for t, v in zip(entry.outputs, entry.versions, strict=True))):
        return tuple(t.detach() for t in entry.outputs)
    return compute()
