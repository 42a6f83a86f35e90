"""The weight average of ``training.weight_averaging`` (EMA or SWA), kept per rank beside the trained weights.

Each rank keeps an fp32 copy of every parameter it holds, in the parameter's own layout: a tensor-parallel
slice, a sequence / graph sharded model's replicated tensors, a data-parallel replica's full copy (the same
values on every replica). Each tensor has its parameter's local shape and lives on its device, so conversion
gathers an average exactly as it gathers the parameters (same names, same partition metadata). After optimizer
step ``s`` (0-based) that the engine took (a skipped step, e.g. a non-finite gradient in DeepSpeed, is none),
with ``s >= start_step`` and ``s % every_n_steps == 0`` (Lightning's rule), under ``no_grad`` and with foreach kernels::

    first update:  avg <- w                                    (the average starts at the weights of that step)
    EMA:           avg <- lerp(avg, w, 1 - decay)  = decay * avg + (1 - decay) * w
    SWA:           avg <- lerp(avg, w, 1 / (n + 1)) = the mean of the n + 1 weights averaged so far

where ``w`` are the fp32 master weights after the step. ``local``, ``ddp`` and DeepSpeed ZeRO 0 (fp32, and bf16:
fp32 parameters under autocast) and DeepSpeed ZeRO 1/2 in fp32 (the parameters are the all-gathered master) keep
the master in the parameters; DeepSpeed ZeRO 1/2 in bf16 keeps it in flat partitions, read through
:meth:`~stormshard.training.engine.base.TrainingEngine.fp32_master_views` where one rank holds it whole (one
data-parallel rank); with several data-parallel ranks each holds a part of it, and ``w`` is then the bf16
parameters widened to fp32 (what Lightning's averaging reads on a bf16 model; gathering the master would
communicate). Frozen parameters
(``training.freeze``) are averaged too: their average is their value, exactly. Nothing is communicated.

Until the first update the average holds the weights the run started with (Lightning's copy at set-up), so a
validation before it sees those. :meth:`WeightAverage.swapped_in` puts the average into the parameters (cast to
their dtype) for validation and the trained values back, bit for bit, afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from stormshard.checkpoint.averaged_weights import AVERAGE_STATE_KEY
from stormshard.training.weight_averaging_config import WeightAveragingSettings

__all__ = ["AVERAGE_STATE_KEY", "WeightAverage", "should_update", "resume_average"]


def should_update(settings: WeightAveragingSettings, step: int) -> bool:
    """Whether optimizer step ``step`` (0-based), once taken, updates the average."""
    return step >= settings.start_step and step % settings.every_n_steps == 0  # Lightning's EMAWeightAveraging


class WeightAverage:
    """An fp32 average of ``module``'s parameters on this rank (see the module docstring).

    ``tensors[i]`` has the local shape and device of the ``i``-th parameter of ``module.named_parameters()``.
    """

    def __init__(self, settings: WeightAveragingSettings, module: nn.Module,
                 masters: Mapping[int, Tensor] | None = None) -> None:
        self.settings = settings
        named = list(module.named_parameters())
        self.names: list[str] = [n for n, _ in named]
        self.params: list[nn.Parameter] = [p for _, p in named]
        # what is averaged: the engine's fp32 master of a parameter where it keeps one apart (``masters``, by
        # ``id(parameter)``: TrainingEngine.fp32_master_views), else the parameter itself
        self.sources: list[Tensor] = [(masters or {}).get(id(p), p) for p in self.params]
        with torch.no_grad():
            self.tensors: list[Tensor] = [s.detach().to(torch.float32, copy=True) for s in self.sources]
        self.updates = 0  # updates so far (the number of weights an SWA mean holds)
        self.last_step = -1  # the optimizer step of the last update

    @torch.no_grad()
    def restart(self) -> None:
        """Start afresh from the parameters as they are now (a resume that turns averaging on, or changes its
        kind): no update yet, the average holds these weights until the first one."""
        torch._foreach_copy_(self.tensors, [s.detach() for s in self.sources])
        self.updates, self.last_step = 0, -1

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's average (what a checkpoint stores of it)."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    @property
    def weight(self) -> float:
        """The lerp weight of the next update: ``1 - decay`` (EMA), ``1 / (updates + 1)`` (SWA)."""
        if self.settings.kind == "ema":
            return 1.0 - float(self.settings.decay)
        return 1.0 / (self.updates + 1)

    @torch.no_grad()
    def update(self, step: int, taken: bool = True) -> bool:
        """Fold the parameters after optimizer step ``step`` (0-based) into the average when ``taken`` (the engine
        stepped) and the schedule asks for it. Returns whether it did. Communicates nothing."""
        if not taken or not should_update(self.settings, step):
            return False
        current = [s.detach() if s.dtype == torch.float32 else s.detach().float() for s in self.sources]
        if self.updates == 0:
            torch._foreach_copy_(self.tensors, current)
        else:
            torch._foreach_lerp_(self.tensors, current, self.weight)
        self.updates += 1
        self.last_step = step
        return True

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """Within the block the parameters hold the average (cast to their dtype); on exit the trained values
        come back bit for bit (a copy of them is kept meanwhile). Communicates nothing."""
        with torch.no_grad():
            data = [p.detach() for p in self.params]
            trained = [d.clone() for d in data]
            torch._foreach_copy_(data, self.tensors)
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(data, trained)

    def describe(self) -> str:
        """``EMA (decay 0.999, from step 0, every step), 12 updates``."""
        return f"{self.settings.describe()}, {self.updates} update{'s' if self.updates != 1 else ''}"

    def state_dict(self) -> dict[str, Any]:
        """This rank's average for its checkpoint: settings, counters and ``{name: fp32 tensor}`` (local shapes)."""
        return {"settings": self.settings.model_dump(mode="json"), "updates": self.updates,
                "last_step": self.last_step, "tensors": dict(zip(self.names, self.tensors, strict=True))}

    def load_state_dict(self, state: Mapping[str, Any]) -> str:
        """Restore what :meth:`state_dict` saved; returns a note for the run log when the settings changed.

        The same kind continues its average (with the current decay and schedule, when those changed); another
        kind starts afresh from the resumed weights. Names and shapes must be this rank's parameters'."""
        stored = WeightAveragingSettings(**state["settings"])
        tensors = state["tensors"]
        problems = [n for n in self.names if n not in tensors] + [n for n in tensors if n not in self.names]
        problems += [f"{n}: {list(tensors[n].shape)} != {list(t.shape)}"
                     for n, t in zip(self.names, self.tensors, strict=True)
                     if n in tensors and tensors[n].shape != t.shape]
        if problems:
            raise ValueError(f"the checkpoint's weight average does not match this rank's parameters: {problems[:5]}")
        if stored.kind != self.settings.kind:
            self.restart()
            return (f"resume: training.weight_averaging: the checkpoint holds a {stored.describe()}, this run asks for "
                    f"a {self.settings.describe()}: the average restarts from the resumed weights")
        with torch.no_grad():
            for name, t in zip(self.names, self.tensors, strict=True):
                t.copy_(tensors[name])
        self.updates, self.last_step = int(state["updates"]), int(state["last_step"])
        if stored != self.settings:
            return (f"resume: training.weight_averaging: the average ({stored.describe()}, {self.updates} updates) "
                    f"continues as a {self.settings.describe()}")
        return ""


def resume_average(average: WeightAverage | None, stored: Mapping[str, Any] | None) -> tuple[str, ...]:
    """At ``--resume``, after the engine's state is loaded: restore ``average`` from the checkpoint's ``stored``
    one, or decide what a change of ``training.weight_averaging`` does. Returns the run log's notes.

    - averaging on in both: the average continues (another kind restarts it from the resumed weights);
    - on now, none stored: the average starts from the resumed weights;
    - off now, one stored: it is left behind (the checkpoints this run writes hold none).
    """
    if average is None:
        return () if stored is None else ("resume: training.weight_averaging is null now: the checkpoint's weight "
                                          f"average ({stored['updates']} updates) is dropped, validation and the "
                                          "checkpoints this run writes use the trained weights",)
    if stored is None:
        average.restart()
        return (f"resume: training.weight_averaging: the checkpoint holds no weight average; a "
                f"{average.settings.describe()} starts from the resumed weights",)
    note = average.load_state_dict(stored)
    return (note,) if note else ()
