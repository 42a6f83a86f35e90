"""The training loop: config -> data, graph, sharded model, engine -> steps, validation, checkpoints.

One optimizer step (:meth:`Trainer.train_step`) runs, for each micro-batch: read (every rank of
a model group gets the same samples, but only its own slice of the grid: no all-gather of the
input; ``parallel.read_group_size`` readers per model group touch the store, see
:mod:`stormshard.data.sharded_read`), forward + loss over ``rollout`` autoregressive steps (the
task, :mod:`stormshard.training.tasks`: deterministic MSE or ensemble CRPS, reduced over the model
group so it is the same number at every layout), backward, engine step. Replicas (data-parallel
ranks, or ensemble groups) read different samples.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from stormshard.data.dataset import ResumableSampler, WindowedSampleDataset
from stormshard.data.normalisation import Normaliser
from stormshard.data.sharded_read import ModelSliceReader, SliceReadPlan
from stormshard.graphs.builder import load_or_build_graph
from stormshard.models.registry import build_model
from stormshard.parallel.comm import all_reduce_sum
from stormshard.parallel.topology import ProcessGroups, build_process_groups
from stormshard.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from stormshard.training.config import ConfigError, ExperimentConfig
from stormshard.training.engine import build_engine
from stormshard.training.metrics_log import MetricsLogger, format_table, rmse_rows
from stormshard.training.preflight import RESUME_MAY_CHANGE, RunInputs, checkpoint_dir, preflight
from stormshard.training.tasks import ForecastTask, NoiseKey, build_task

__all__ = ["Trainer", "TrainResult", "train"]


@dataclass
class TrainResult:
    """What a run returns on every rank."""

    losses: list[float] = field(default_factory=list)  # per optimizer step, mean over replicas
    validation: dict[str, dict[str, float]] = field(default_factory=dict)  # {"rmse": ..., "persistence": ...}
    checkpoint: str | None = None
    output_dir: str = ""


def _device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


class Trainer:
    """Builds everything from an :class:`ExperimentConfig` (validated before any group or file is
    made) and runs the loop. ``torch.distributed`` must be initialised when the world is larger
    than one process (``launch/train.py`` does it)."""

    def __init__(self, config: ExperimentConfig, resume: bool = False, inputs: RunInputs | None = None) -> None:
        self.config, self.resume = config, resume
        world, self.rank = _world()
        inputs = inputs or preflight(config, world, resume=resume)
        self.layout, self.dataset, self.variables = inputs.layout, inputs.dataset, inputs.variables
        self.train_samples, self.val_samples = inputs.train_samples, inputs.val_samples
        self.total_steps, self.settings, self.plan_batch = inputs.total_steps, inputs.settings, inputs.plan_batch
        self.output_dir = Path(config.training.output_dir)
        t = config.training

        # ---- process groups, graph, model, engine
        self.groups: ProcessGroups = build_process_groups(self.layout)
        self.device = _device()
        self.graph = self._graph()
        torch.manual_seed(t.seed)
        model = build_model(config.model, self.graph, self.variables, self.groups.model_group).to(self.device)
        self.plan = model.plan
        self.engine = build_engine(model, self.groups, self.settings)
        self.dtype = torch.bfloat16 if (config.engine == "deepspeed" and
                                        (config.deepspeed.get("bf16") or {}).get("enabled")) else torch.float32

        stats, names = self.dataset.statistics, self.dataset.variables
        methods = dict(config.data.normalisation_methods)
        self.normaliser = Normaliser.from_statistics(stats, names, methods=methods,
                                                     default=config.data.normalisation).to(self.device)
        self.output_normaliser = Normaliser.from_statistics(stats, names, variables=self.variables.output_names,
                                                            methods=methods, default=config.data.normalisation
                                                            ).to(self.device)
        self.area = self.graph["data"].area_weight[self.plan.data_slice].to(self.device, torch.float32)
        self.task: ForecastTask = build_task(config, self.groups, self.variables, self.area, model, self.dtype)
        self.replicas = self.task.replicas
        self.reader = ModelSliceReader(
            SliceReadPlan(tuple(self.plan.data_sizes), self.layout.read_group_size, self.plan.rank),
            self.groups.model_group, self.device)
        self.sampler = ResumableSampler(len(self.train_samples), seed=t.seed, rank=self.task.replica_rank,
                                        world_size=self.replicas)
        self.consumed = 0
        self.logger: MetricsLogger | None = None

    def _graph(self):  # noqa: ANN202
        cache = Path(self.config.data.graph_cache or self.output_dir / "graph.pt")
        latlon = (self.dataset.latitudes, self.dataset.longitudes) if self.config.graph.data_grid is None else None
        if self.rank == 0:
            graph = load_or_build_graph(self.config.graph, cache, data_latlon=latlon)
        if dist.is_initialized():
            dist.barrier()
        if self.rank != 0:
            graph = load_or_build_graph(self.config.graph, cache, data_latlon=latlon)
        return graph

    # ------------------------------------------------------------------ data
    def read_batch(self, samples: WindowedSampleDataset, indices: list[int]) -> Tensor:
        """``(batch, time, grid_local, variables)``: this rank's grid slice of samples ``indices``,
        normalised. Every rank of the model group calls it with the same indices (the readers of
        ``parallel.read_group_size`` hand the other ranks their slices)."""
        batch = self.reader.read(samples, indices)
        return self.normaliser.normalise(batch.to(self.device, torch.float64)).to(self.dtype)

    def _next_indices(self) -> list[int]:
        out: list[int] = []
        while len(out) < self.config.micro_batch:
            if not hasattr(self, "_order") or self._cursor >= len(self._order):
                if hasattr(self, "_order"):
                    self.sampler.set_epoch(self.sampler.epoch + 1)
                    self.consumed = 0
                self._order = list(self.sampler.remaining())
                self._cursor = 0
            out.append(self._order[self._cursor])
            self._cursor += 1
            self.consumed += 1
        return out

    # ------------------------------------------------------------------ the training step
    def train_step(self, step: int) -> float:
        """One optimizer step; returns its loss, averaged over micro-batches and replicas."""
        step_loss = 0.0
        for micro in range(self.settings.accumulation):
            batch = self.read_batch(self.train_samples, self._next_indices())   # read
            loss = self.task.forecast_loss(self.engine, batch, step, micro)       # forward + loss (rollout)
            self.engine.backward(loss * self.task.loss_scale)                     # backward
            self.engine.step()                                                    # step (at the boundary)
            step_loss += float(loss.detach()) / self.settings.accumulation
        return self._replica_mean(step_loss)

    def _replica_mean(self, value: float) -> float:
        if self.replicas == 1 or not dist.is_initialized():
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        return float(all_reduce_sum(t, self.task.replica_group)[0]) / self.replicas

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate(self) -> dict[str, dict[str, float]]:
        """Area-weighted RMSE per output variable (physical units) of the model and of persistence,
        over ``data.validation_samples`` windows shared out over the replicas."""
        self.engine.eval()
        v, m = self.variables, self.config.model.multistep_input
        count = min(self.config.data.validation_samples, len(self.val_samples))
        mine = list(range(self.task.replica_rank, count, self.replicas))
        n_out = len(v.output_names)
        sums = torch.zeros(2 * n_out + 1, dtype=torch.float64, device=self.device)
        for i in mine:
            batch = self.read_batch(self.val_samples, [i])
            pred = self.task.predict(self.engine, batch, NoiseKey(step=-1, micro=i))
            truth = self.output_normaliser.denormalise(batch[:, m][..., v.output_idx].double())
            model = self.output_normaliser.denormalise(pred.double())
            persist = self.output_normaliser.denormalise(batch[:, m - 1][..., v.output_idx].double())
            a = self.area.double()[None, :, None]
            sums[:n_out] += ((model - truth) ** 2 * a).sum(dim=(0, 1))
            sums[n_out:2 * n_out] += ((persist - truth) ** 2 * a).sum(dim=(0, 1))
            sums[-1] += self.area.double().sum()
        if dist.is_initialized():
            dist.all_reduce(sums)
        self.engine.train()
        denom = sums[-1].clamp_min(1e-300)
        rmse = (sums[:n_out] / denom).sqrt().tolist()
        pers = (sums[n_out:2 * n_out] / denom).sqrt().tolist()
        return {"rmse": dict(zip(v.output_names, rmse, strict=True)),
                "persistence": dict(zip(v.output_names, pers, strict=True))}

    # ------------------------------------------------------------------ checkpoints
    def _config_dict(self) -> dict[str, Any]:
        return self.config.model_dump(mode="json")

    def _layout_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.layout)

    def save(self, step: int) -> Path:
        state = {"engine": self.engine.state_dict(), "data": self.sampler.state_dict(consumed=self.consumed),
                 "step": step}
        world, _ = _world()
        return save_checkpoint(checkpoint_dir(self.config), step, state, self._config_dict(), self._layout_dict(),
                               self.rank, world, model=self.engine.module,
                               keep_last=self.config.training.keep_checkpoints)

    def _maybe_resume(self) -> int:
        if not self.resume:
            return 0
        directory = checkpoint_dir(self.config)
        if latest_checkpoint(directory) is None:  # preflight checks this; a checkpoint may vanish since
            raise ConfigError(f"--resume was given but {directory} holds no checkpoint: remove --resume to start a "
                              "new run, or point training.output_dir at the run to continue")
        world, _ = _world()
        loaded = load_checkpoint(directory, self.rank, config=self._config_dict(), layout=self._layout_dict(),
                                 world=world, ignore=RESUME_MAY_CHANGE)
        self.engine.load_state_dict(loaded.state["engine"])
        self.sampler.load_state_dict(loaded.state["data"])
        self._order, self._cursor = list(self.sampler.remaining()), 0
        self.consumed = int(loaded.state["data"]["position"])
        return int(loaded.state["step"])

    # ------------------------------------------------------------------ the loop
    def describe(self) -> str:
        b = self.plan_batch
        return (f"layout: {self.layout.describe()}\n"
                f"batch:  {b.describe()}\n"
                f"model:  {self.config.model.name}"
                f"{'' if self.config.model.uses_graph_processor else ' (' + self.config.model.processor.shard_strategy + ')'}, "
                f"{sum(p.numel() for p in self.engine.module.parameters()):,} parameters on this rank; "
                f"grid {self.plan.num_data} cells ({self.plan.data_sizes[self.plan.rank]} here), hidden "
                f"{self.plan.num_hidden} nodes; engine {self.config.engine} on {self.device}")

    def fit(self) -> TrainResult:
        """Resume if asked, run the steps with logging, validation and checkpoints, validate at the end."""
        t, lg = self.config.training, self.config.logging
        start = self._maybe_resume()
        result = TrainResult(output_dir=str(self.output_dir))
        self.logger = MetricsLogger(self.output_dir, rank=self.rank, total_steps=self.total_steps,
                                    initial_step=start, progress=lg.progress, wandb=lg.wandb,
                                    wandb_mode=lg.wandb_mode, project=lg.project, run_name=self.config.name,
                                    config=self._config_dict())
        self.logger.write(self.describe())
        self.engine.train()
        samples_per_step = self.plan_batch.effective_batch
        last_saved = None
        try:
            for step in range(start, self.total_steps):
                tic = time.perf_counter()
                mean_loss = self.train_step(step)
                if not math.isfinite(mean_loss):
                    raise FloatingPointError(f"the loss became {mean_loss} at step {step}: lower training.lr")
                result.losses.append(mean_loss)
                if (step + 1) % lg.log_interval == 0 or step + 1 == self.total_steps:
                    self.logger.log(step + 1, {"loss": mean_loss, "lr": self.engine.lr,
                                               "step_time": time.perf_counter() - tic},
                                    samples=samples_per_step * lg.log_interval)
                if (step + 1) % t.validation_interval == 0 and step + 1 < self.total_steps:
                    metrics = self.validate()
                    self.logger.log(step + 1, {f"val_rmse/{k}": x for k, x in metrics["rmse"].items()})
                if (step + 1) % t.checkpoint_interval == 0:
                    last_saved = self.save(step + 1)
            if last_saved is None or int(last_saved.name.split("_")[-1]) != self.total_steps:
                last_saved = self.save(self.total_steps)
            result.checkpoint = str(last_saved)
            result.validation = self.validate()
            self.logger.log(self.total_steps, {f"val_rmse/{k}": x for k, x in result.validation["rmse"].items()})
            table = format_table(rmse_rows(result.validation["rmse"], result.validation["persistence"]))
            self.logger.write(f"\nvalidation RMSE against persistence ({self.config.data.validation_samples} "
                              f"windows):\n{table}\ncheckpoint: {last_saved}\nmetrics:    "
                              f"{self.output_dir / 'metrics.jsonl'}")
        finally:
            self.logger.close()
        return result


def train(config: ExperimentConfig, resume: bool = False, inputs: RunInputs | None = None) -> TrainResult:
    """Build a :class:`Trainer` and run it."""
    return Trainer(config, resume=resume, inputs=inputs).fit()
