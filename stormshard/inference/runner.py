"""The sharded rollout: who forecasts what, and the autoregressive loop on this rank's grid slice.

Work: every (initial date, member) pair is one task; the ``world / K`` data-parallel replicas
(model groups of K ranks) take tasks round-robin (:func:`replica_tasks`), and a replica runs the
members of one date it holds as one batch. Every rank of a model group runs the same batches.

The rollout (:func:`rollout_steps`) follows training (:func:`~stormshard.models.rollout.advance_window`):
each prediction replaces the prognostic variables of the next input state, forcings come from the
dataset at the predicted time. It runs on any grid (the whole grid in one process, or this
rank's slice: normalisation is per variable, and the model communicates inside its layers).
Ensemble noise comes from one generator per (seed, initial date, member) and is drawn for the
full hidden grid and sliced (:meth:`EnsembleEncoderProcessorDecoder.sample_noise`), so a member
gets the same noise whichever rank and layout runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor

from stormshard.checkpoint.export import InferenceModel
from stormshard.models.rollout import advance_window

__all__ = ["replica_tasks", "member_generator", "member_noise", "rollout_steps", "rollout"]


def replica_tasks(num_dates: int, members: int, replicas: int, replica: int) -> list[tuple[int, list[int]]]:
    """This replica's batches: ``[(date position, [members])]``, tasks ``(date, member)`` dealt
    round-robin over the ``replicas`` (dates first, so several dates spread before members do)."""
    tasks = [(d, m) for m in range(members) for d in range(num_dates)]
    mine = sorted(tasks[replica::replicas])
    out: dict[int, list[int]] = {}
    for d, m in mine:
        out.setdefault(d, []).append(m)
    return list(out.items())


def member_generator(seed: int, init_date: np.datetime64, member: int, device: torch.device | str = "cpu"
                     ) -> torch.Generator:
    """The noise generator of ``member`` of the forecast from ``init_date`` (independent of the layout)."""
    stamp = int(np.datetime64(init_date, "s").astype(np.int64))
    state = np.random.SeedSequence([seed, member, stamp & 0xFFFFFFFF, stamp >> 32 & 0xFFFFFFFF]).generate_state(2)
    return torch.Generator(device=device).manual_seed(int(state[0]) << 31 ^ int(state[1]))


def member_noise(model: torch.nn.Module, generators: Sequence[torch.Generator]) -> Callable[[int], Tensor]:
    """``noise(step)`` -> ``(members, hidden_local, noise_channels)``: one draw per member and step."""

    def draw(step: int) -> Tensor:
        return torch.cat([model.sample_noise(1, generator=g, dtype=torch.float32) for g in generators])

    return draw


@torch.inference_mode()
def rollout_steps(forecaster: InferenceModel, states: Tensor, forcings: Tensor,
                  noise: Callable[[int], Tensor] | None = None) -> Iterator[Tensor]:
    """Yield the forecast of each lead step, physical units, float64.

    ``states``: ``(batch, multistep_input, grid, input_variables)`` physical; ``forcings``:
    ``(batch, steps - 1, grid, input_variables)`` physical (only the forcing columns are read);
    ``grid`` is the whole grid or this rank's slice. Yields ``(batch, grid, output_variables)``
    ``steps`` times. The model runs in its parameters' dtype; normalisation in float64.
    ``noise(step)``: the ensemble noise of that step (None: deterministic model); an ensemble model
    also gets the step index (its ``fcstep_input``).
    """
    v = forecaster.variables
    dtype = next(forecaster.model.parameters()).dtype
    x = forecaster.normaliser.normalise(states.double()).to(dtype)
    f = forecaster.normaliser.normalise(forcings.double())
    prog_in, prog_out = v.prognostic_in_input, v.prognostic_in_output
    for k in range(f.shape[1] + 1):
        pred = forecaster.model(x) if noise is None else forecaster.model(x, noise(k), step=k)
        yield forecaster.output_normaliser.denormalise(pred.double())
        if k < f.shape[1]:
            x = advance_window(x, f[:, k].to(dtype), pred, prog_in, prog_out)


def rollout(forecaster: InferenceModel, states: Tensor, forcings: Tensor,
            noise: Callable[[int], Tensor] | None = None) -> Tensor:
    """:func:`rollout_steps` stacked: ``(batch, steps, grid, output_variables)``."""
    return torch.stack(list(rollout_steps(forecaster, states, forcings, noise)), dim=1)
