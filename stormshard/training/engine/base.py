"""The engine interface: DeepSpeed's calling convention, once per micro-batch.

::

    loss = loss_fn(engine(batch))
    engine.backward(loss)   # scales by 1 / gradient_accumulation_steps
    engine.step()           # reduce, clip, optimizer + scheduler step only at the accumulation boundary
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

from torch import Tensor, nn

from stormshard.parallel.compression import PowerSGDCompressor
from stormshard.parallel.topology import ProcessGroups
from stormshard.training.engine.settings import EngineSettings

__all__ = ["TrainingEngine", "check_state_keys", "arg_names"]


class TrainingEngine(ABC):
    """One interface over DeepSpeed, DDP and local training (DeepSpeed's calling convention)."""

    module: nn.Module
    groups: ProcessGroups
    settings: EngineSettings
    compressor: PowerSGDCompressor | None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    @abstractmethod
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the (wrapped) module."""

    @abstractmethod
    def backward(self, loss: Tensor) -> None:
        """Backward of ``loss / gradient_accumulation_steps``; reductions as configured."""

    @abstractmethod
    def step(self) -> bool:
        """Count one micro-batch; at the accumulation boundary reduce, clip, step the optimizer and
        the schedule and zero the gradients. Returns whether an optimizer step was taken."""

    @abstractmethod
    def zero_grad(self) -> None: ...

    @property
    @abstractmethod
    def lr(self) -> float:
        """Learning rate the next optimizer step uses."""

    @property
    @abstractmethod
    def global_step(self) -> int:
        """Optimizer steps taken so far."""

    @property
    @abstractmethod
    def micro_steps(self) -> int:
        """Micro-batches stepped so far."""

    def fp32_master_views(self) -> dict[int, Tensor]:
        """``{id(parameter): its fp32 master}`` (views, the parameter's shape) where the engine keeps the master
        apart from the parameters and this rank holds all of it; empty where the parameters are the master (fp32
        parameters) or where the master is spread over ranks."""
        return {}

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps the engine skipped at an accumulation boundary (DeepSpeed: a non-finite gradient with a
        loss scaler); 0 for engines that never skip. A boundary ``step()`` that raises this count took no step."""
        return 0

    @property
    def micro_batch_size(self) -> int:
        """Samples per model replica per micro-step (``EngineSettings.micro_batch_size``)."""
        return self.settings.micro_batch_size

    @property
    def accumulation(self) -> int:
        """Micro-steps per optimizer step (``EngineSettings.gradient_accumulation_steps``)."""
        return self.settings.accumulation

    def is_accumulation_boundary(self) -> bool:
        """Whether the current micro-batch (the next one ``step()`` counts) ends an accumulation window."""
        return (self.micro_steps + 1) % self.accumulation == 0

    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This rank's model, optimizer, scheduler, compressor and counters."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def train(self, mode: bool = True) -> TrainingEngine:
        self.module.train(mode)
        return self

    def eval(self) -> TrainingEngine:
        return self.train(False)


def check_state_keys(state: dict[str, Any], keys: tuple[str, ...]) -> None:
    """Raise ``KeyError`` naming the keys of ``keys`` missing from an engine state dict."""
    missing = [k for k in keys if k not in state]
    if missing:
        raise KeyError(f"engine state lacks {missing}: it was not written by this engine's state_dict()")


def arg_names(fn: Callable) -> tuple[str, ...]:
    """Positional parameter names of a plain function (empty for builtins)."""
    code = getattr(fn, "__code__", None)
    return code.co_varnames[: code.co_argcount] if code is not None else ()
