"""The autoregressive rollout update, shared by training and inference.

After a forecast step the input window moves one step forward: its oldest state drops out and a
new newest state is appended, whose prognostic variables are the prediction and whose other
input variables (forcings) come from the data at the predicted time. Diagnostic outputs are not
fed back. This is the one place that rule is written (training rollout: ``training/tasks.py``;
inference: ``inference/forecast.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["advance_window", "forecast_step_flag"]


def _index(indices: Tensor | Sequence[int], device: torch.device) -> Tensor:
    if isinstance(indices, Tensor):
        return indices.to(device=device, dtype=torch.long)
    return torch.tensor(list(indices), dtype=torch.long, device=device)


def advance_window(window: Tensor, forcing: Tensor, prediction: Tensor, prognostic_in_input: Tensor | Sequence[int],
                   prognostic_in_output: Tensor | Sequence[int]) -> Tensor:
    """The next input window after a forecast step.

    Layouts (any grid: the full grid or this rank's slice, the same in all three):

    - ``window``: ``(batch, multistep_input, grid, input_variables)``, oldest state first;
    - ``forcing``: ``(batch, grid, input_variables)``, the inputs at the predicted time (only the
      non-prognostic columns are used);
    - ``prediction``: ``(batch, grid, output_variables)``, the model's output for that time.

    ``prognostic_in_input`` / ``prognostic_in_output``: positions of the prognostic variables
    among the input / output variables (``VariableIndex.prognostic_in_input`` /
    ``prognostic_in_output``), in the same order.

    Returns ``(batch, multistep_input, grid, input_variables)``: ``window[:, 1:]`` followed by the
    new state, in ``window``'s dtype. Differentiable with respect to ``prediction`` (training
    backpropagates through the rollout). Communicates nothing.
    """
    if window.dim() != 4 or forcing.dim() != 3 or prediction.dim() != 3:
        raise ValueError(f"window must be (batch, time, grid, input_variables), forcing (batch, grid, input_variables) "
                         f"and prediction (batch, grid, output_variables); got {tuple(window.shape)}, "
                         f"{tuple(forcing.shape)} and {tuple(prediction.shape)}")
    if forcing.shape != window.shape[:1] + window.shape[2:] or prediction.shape[:2] != forcing.shape[:2]:
        raise ValueError(f"window {tuple(window.shape)}, forcing {tuple(forcing.shape)} and prediction "
                         f"{tuple(prediction.shape)} disagree on batch, grid or input variables")
    prog_in = _index(prognostic_in_input, forcing.device)
    prog_out = _index(prognostic_in_output, prediction.device)
    if prog_in.numel() != prog_out.numel():
        raise ValueError(f"{prog_in.numel()} prognostic input positions but {prog_out.numel()} output positions: "
                         "pass VariableIndex.prognostic_in_input and prognostic_in_output")
    newest = forcing.to(window.dtype).index_copy(-1, prog_in, prediction[..., prog_out].to(window.dtype))
    return torch.cat([window[:, 1:], newest.unsqueeze(1)], dim=1)


def forecast_step_flag(step: int) -> int:
    """The forecast-step input of an ensemble model with ``ensemble.fcstep_input`` (anemoi's ``fcstep``): 0 on
    the first step of a rollout (``step`` 0, from the initial state), 1 on every later step. Training's rollout
    and inference's forecast pass their step index (0-based) to the model, which reads it through this."""
    if step < 0:
        raise ValueError(f"step={step}: the rollout step index counts from 0")
    return min(1, step)
