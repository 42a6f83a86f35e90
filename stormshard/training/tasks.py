"""Training tasks: what a deterministic and an ensemble forecaster do differently in a step.

The trainer's step is the same for both (read, forward, loss, backward, step); a task owns the
rest, chosen once from the config by :func:`task_type`:

- :class:`ForecastTask` (deterministic models): one prediction per initial state, the area-weighted
  pointwise loss of ``training.loss`` (MSE by default); the sample stream is split over the data-parallel replicas (``world / gpus_per_model``).
- :class:`EnsembleForecastTask` (``model.name == "ensemble"``): each initial state is repeated
  over ``ensemble_size_per_device`` members per model group, each member gets its own noise, the
  members of the ensemble group's model groups are gathered (over the ensemble-member group) for
  the almost-fair CRPS, and the loss is scaled by ``ensemble_groups_factor``; the sample stream is
  split over the ensemble groups (``world / gpus_per_ensemble``).

Tensor layouts: a normalised batch is ``(batch, time, grid_local, variables)`` with every dataset
variable (``time = multistep_input + rollout``: the batch carries the rollout of its step); model
inputs ``(batch, multistep_input, grid_local, input_variables)``; predictions ``(batch, grid_local,
output_variables)``; with members, "batch" is ``(batch members)``, member fastest.

Missing values: the batch keeps the store's NaNs. Inputs are imputed here (a NaN input becomes
its variable's fill value, ``data.imputation``, normalised; the mean by default, i.e. 0), also in
the states fed back during the rollout (cells whose truth is missing get the fill value, as at
the first step), and the loss skips NaN targets through a mask (``~isnan(target)``), elementwise,
so it is the same at every layout. Loss weights: ``loss_weights`` per output variable
(:mod:`stormshard.models.loss_weights`) times the area weights.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from einops import rearrange, repeat
from torch import Tensor, nn

from stormshard.models.rollout import advance_window
from stormshard.models.variables import VariableIndex
from stormshard.parallel.comm import gather_tensor
from stormshard.parallel.topology import ParallelLayout, ProcessGroups
from stormshard.training.config import ExperimentConfig
from stormshard.training.losses import AlmostFairCRPSLoss, WeightedPointwiseLoss
from stormshard.training.rollout_schedule import max_rollout

__all__ = ["NoiseKey", "ForecastTask", "EnsembleForecastTask", "task_type", "build_task"]

Model = Callable[..., Tensor]


@dataclass(frozen=True)
class NoiseKey:
    """Where a forward pass sits in the run: optimizer ``step`` (-1 for validation), ``micro``-batch
    (the sample index in validation) and ``rollout`` step. Seeds the ensemble noise."""

    step: int
    micro: int
    rollout: int = 0


class ForecastTask:
    """The deterministic forecaster: MSE over the rollout, replicas are the data-parallel ranks.

    ``area``: ``(grid_local,)`` this rank's node weights. Every rank of a model group must call
    :meth:`forecast_loss` / :meth:`predict` together (the model and the loss communicate over it).
    """

    name = "forecast"

    def __init__(self, config: ExperimentConfig, groups: ProcessGroups, variables: VariableIndex, area: Tensor,
                 dtype: torch.dtype = torch.float32, *, loss_weights: Sequence[float] | None = None,
                 input_fill: Tensor | None = None) -> None:
        self.config, self.groups, self.variables = config, groups, variables
        self.area, self.dtype = area, dtype
        self.multistep, self.rollout = config.model.multistep_input, max_rollout(config.training.rollout)
        self.prognostic_in_input = torch.tensor(variables.prognostic_in_input, device=area.device)
        self.prognostic_in_output = torch.tensor(variables.prognostic_in_output, device=area.device)
        n_out, n_in = len(variables.output_names), len(variables.input_names)
        weights = torch.ones(n_out) if loss_weights is None else torch.tensor(list(loss_weights), dtype=torch.float32)
        if weights.shape != (n_out,):
            raise ValueError(f"loss_weights has {weights.numel()} entries but there are {n_out} output variables")
        fill = torch.zeros(n_in) if input_fill is None else torch.as_tensor(input_fill)
        if fill.shape != (n_in,):
            raise ValueError(f"input_fill has {fill.numel()} entries but there are {n_in} input variables")
        self.input_fill = fill.to(area.device, torch.float32)
        self.loss_fn = self.build_loss(weights.to(area.device))

    @classmethod
    def build(cls, config: ExperimentConfig, groups: ProcessGroups, variables: VariableIndex, area: Tensor,
              model: nn.Module, dtype: torch.dtype = torch.float32, **options: object) -> ForecastTask:
        """The task for this rank; ``model``: the unwrapped model; ``options``: ``loss_weights``, ``input_fill``."""
        return cls(config, groups, variables, area, dtype, **options)

    # ---- what differs between tasks ----------------------------------------------------------
    @staticmethod
    def replica_count(layout: ParallelLayout) -> int:
        """Independent sample streams: the data-parallel replicas."""
        return layout.data_parallel_size

    @staticmethod
    def members_per_model(config: ExperimentConfig) -> int:
        """Predictions per initial state on one model group."""
        return 1

    def build_loss(self, variable_weights: Tensor) -> nn.Module:
        t = self.config.training
        return WeightedPointwiseLoss(variable_weights, t.loss, t.huber_delta)

    @property
    def replicas(self) -> int:
        return self.replica_count(self.groups.layout)

    @property
    def replica_rank(self) -> int:
        """Which sample stream this rank reads."""
        return self.groups.data_parallel_rank

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        """The ranks that read different samples with the same model slice (the loss is averaged over it)."""
        return self.groups.data_parallel_group

    @property
    def loss_scale(self) -> float:
        """Factor on the loss before backward (the engine averages gradients over all replicas)."""
        return 1.0

    def repeat_members(self, x: Tensor) -> Tensor:
        """``(batch, ...)`` -> ``(batch members, ...)``; the identity here."""
        return x

    def forward(self, model: Model, x: Tensor, key: NoiseKey) -> Tensor:
        """``x`` ``(batch, multistep_input, grid_local, input_variables)`` -> ``(batch, grid_local, output_variables)``."""
        return model(x)

    def loss(self, pred: Tensor, target: Tensor, mask: Tensor | None = None) -> Tensor:
        """``pred`` ``(batch members, grid_local, output_variables)``, ``target`` ``(batch, grid_local,
        output_variables)``, ``mask`` (True = valid target, same shape as target) -> the full-grid
        loss (a scalar, equal on every rank of the model group)."""
        return self.loss_fn(pred.float(), target, self.area, self.groups.model_group, mask=mask)

    # ---- shared ------------------------------------------------------------------------------
    def impute(self, x: Tensor) -> Tensor:
        """``x`` ``(..., input_variables)`` with each NaN replaced by its variable's fill value."""
        return torch.where(torch.isnan(x), self.input_fill.to(x.dtype), x)

    def next_window(self, x: Tensor, state: Tensor, pred: Tensor) -> Tensor:
        """The window after predicting ``state``'s time: ``state`` ``(batch, grid_local,
        input_variables)`` is the stored (normalised, un-imputed) input at that time; its forcings
        are used, and cells whose stored value is missing get the fill value (prognostic ones too,
        as the model saw them at the first step)."""
        missing = torch.isnan(state)
        x = advance_window(x, self.impute(state), pred, self.prognostic_in_input, self.prognostic_in_output)
        newest = torch.where(missing, self.input_fill.to(x.dtype), x[:, -1])
        return torch.cat([x[:, :-1], newest.unsqueeze(1)], dim=1)

    def forecast_loss(self, model: Model, batch: Tensor, step: int = 0, micro: int = 0) -> Tensor:
        """Mean loss over the rollout of a normalised batch ``(batch, time, grid_local, variables)``
        (``time - multistep_input`` autoregressive steps); gradients flow through the rollout."""
        m, v = self.multistep, self.variables
        rollout = batch.shape[1] - m
        if rollout < 1:
            raise ValueError(f"the batch has {batch.shape[1]} times: it needs multistep_input={m} plus at least one")
        x = self.repeat_members(self.impute(batch[:, :m][..., v.input_idx]))
        total = batch.new_zeros((), dtype=torch.float32)
        for r in range(rollout):
            pred = self.forward(model, x, NoiseKey(step, micro, r))
            target = batch[:, m + r][..., v.output_idx].float()
            total = total + self.loss(pred, target, ~torch.isnan(target)) / rollout
            if r + 1 < rollout:
                x = self.next_window(x, self.repeat_members(batch[:, m + r][..., v.input_idx]), pred)
        return total

    def predict_step(self, model: Model, x: Tensor, key: NoiseKey) -> Tensor:
        """One member per initial state from an imputed window ``x`` ``(batch, multistep_input,
        grid_local, input_variables)``: ``(batch, grid_local, output_variables)``."""
        return self.forward(model, x, key)

    def predict(self, model: Model, batch: Tensor, key: NoiseKey) -> Tensor:
        """One step from a normalised batch ``(batch, time, grid_local, variables)``, one member per
        initial state: ``(batch, grid_local, output_variables)`` (validation)."""
        return self.predict_step(model, self.impute(batch[:, :self.multistep][..., self.variables.input_idx]), key)

    def predict_rollout(self, model: Model, batch: Tensor, key: NoiseKey) -> list[Tensor]:
        """``time - multistep_input`` steps from a normalised batch, one member per initial state:
        one ``(batch, grid_local, output_variables)`` per lead time (validation)."""
        m, v = self.multistep, self.variables
        x = self.impute(batch[:, :m][..., v.input_idx])
        preds = []
        for r in range(batch.shape[1] - m):
            pred = self.predict_step(model, x, NoiseKey(key.step, key.micro, r))
            preds.append(pred)
            if r + 1 < batch.shape[1] - m:
                x = self.next_window(x, batch[:, m + r][..., v.input_idx], pred)
        return preds


class EnsembleForecastTask(ForecastTask):
    """The ensemble forecaster: members with their own noise, almost-fair CRPS over all members of
    an initial state, replicas are the ensemble groups.

    ``sample_noise(batch, generator=, dtype=)``: the model's noise sampler (this rank's slice of a
    full-grid noise field, ``(batch, hidden_local, noise_channels)``).

    Member ``g`` of an initial state (``g = ensemble_member_rank * ensemble_size_per_device + j``
    for local member ``j``) draws its noise from a generator seeded by the run seed, the
    :class:`NoiseKey`, the replica and ``g``: the same members get the same noise at every layout
    (members spread over ranks or all on one).
    Communicates: the members' predictions are all-gathered over the ensemble-member group (the
    model groups of one ensemble group; backward hands each rank the gradient of its own members).
    """

    name = "ensemble"

    def __init__(self, config: ExperimentConfig, groups: ProcessGroups, variables: VariableIndex, area: Tensor,
                 sample_noise: Callable[..., Tensor], dtype: torch.dtype = torch.float32,
                 **options: object) -> None:
        self.members = self.members_per_model(config)
        super().__init__(config, groups, variables, area, dtype, **options)
        self.sample_noise = sample_noise

    @classmethod
    def build(cls, config: ExperimentConfig, groups: ProcessGroups, variables: VariableIndex, area: Tensor,
              model: nn.Module, dtype: torch.dtype = torch.float32, **options: object) -> EnsembleForecastTask:
        return cls(config, groups, variables, area, model.sample_noise, dtype, **options)

    @staticmethod
    def replica_count(layout: ParallelLayout) -> int:
        """Independent sample streams: the ensemble groups."""
        return layout.num_ensemble_groups

    @staticmethod
    def members_per_model(config: ExperimentConfig) -> int:
        return config.parallel.ensemble_size_per_device

    def build_loss(self, variable_weights: Tensor) -> nn.Module:
        return AlmostFairCRPSLoss(variable_weights, alpha=self.config.training.crps_alpha)

    @property
    def replica_rank(self) -> int:
        return self.groups.ensemble_data_parallel_rank

    @property
    def replica_group(self) -> dist.ProcessGroup | None:
        return self.groups.ensemble_data_parallel_group

    @property
    def loss_scale(self) -> float:
        """``ensemble_groups_factor``: every model group of an ensemble group holds the same full
        loss but only its members' gradient, and the engine averages over all of them."""
        return float(self.config.ensemble_groups_factor)

    @property
    def first_member(self) -> int:
        """Index of this rank's first member among all members of its initial state."""
        member_rank = self.groups.ensemble_member_rank if self.groups.ensemble_member_group is not None else 0
        return member_rank * self.members

    def repeat_members(self, x: Tensor) -> Tensor:
        return repeat(x, "b ... -> (b e) ...", e=self.members)

    def noise(self, batch: int, key: NoiseKey, members: int) -> Tensor:
        """``(batch members, hidden_local, noise_channels)`` for this rank's first ``members`` members."""
        device = self.area.device
        fields = []
        for j in range(members):
            seed = hash((self.config.training.seed, key.step, key.micro, key.rollout, self.replica_rank,
                         self.first_member + j)) % (2**63)
            gen = torch.Generator(device=device).manual_seed(seed)
            fields.append(self.sample_noise(batch, generator=gen, dtype=self.dtype))
        return rearrange(torch.stack(fields), "e b n c -> (b e) n c")

    def forward(self, model: Model, x: Tensor, key: NoiseKey) -> Tensor:
        """``x``: ``(batch members, ...)`` (after :meth:`repeat_members`); the model gets the rollout step
        (``key.rollout``: anemoi's fcstep input, ``model.ensemble.fcstep_input``)."""
        return model(x, self.noise(x.shape[0] // self.members, key, self.members), step=key.rollout)

    def predict_step(self, model: Model, x: Tensor, key: NoiseKey) -> Tensor:
        """One step of this rank's first member per initial state (validation)."""
        return model(x, self.noise(x.shape[0], key, 1), step=key.rollout)

    def loss(self, pred: Tensor, target: Tensor, mask: Tensor | None = None) -> Tensor:
        ens = rearrange(pred.float(), "(b e) g v -> b e g v", e=self.members)
        group = self.groups.ensemble_member_group
        size = dist.get_world_size(group) if group is not None else 1
        ens = gather_tensor(ens, 1, [list(ens.shape)] * size, group)  # (batch, all members, grid_local, variables)
        return self.loss_fn(ens, target, self.area, self.groups.model_group, mask=mask)


def task_type(config: ExperimentConfig) -> type[ForecastTask]:
    """The task of ``config``: the one place that looks at ``model.name``."""
    return EnsembleForecastTask if config.model.name == "ensemble" else ForecastTask


def build_task(config: ExperimentConfig, groups: ProcessGroups, variables: VariableIndex, area: Tensor,
               model: nn.Module, dtype: torch.dtype = torch.float32, *, loss_weights: Sequence[float] | None = None,
               input_fill: Tensor | None = None) -> ForecastTask:
    """The task for ``config`` on this rank; ``model``: the unwrapped model (its noise sampler);
    ``loss_weights``: per output variable (default 1); ``input_fill``: normalised NaN fill per input
    variable (default 0)."""
    return task_type(config).build(config, groups, variables, area, model, dtype, loss_weights=loss_weights,
                                   input_fill=input_fill)
