"""The training loop: config -> data, graph, sharded model, engine -> steps, validation, checkpoints.

Per optimizer step and micro-batch, every rank of a model group reads the same samples, but only
its own slice of the grid (its model slice: no all-gather of the input at all), normalises it,
runs the sharded model for ``rollout`` autoregressive steps, and computes the loss on its sharded
output; the loss is reduced over the model group (so it is the same number at every layout).
Replicas (data-parallel ranks) read different samples. Ensemble models repeat each initial state
over ``ensemble_size_per_device`` members per model group and gather the members of the ensemble
group's model groups for the almost-fair CRPS.
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
from einops import rearrange, repeat
from torch import Tensor

from stormshard.data.anemoi_layout import AnemoiDataset
from stormshard.data.dataset import ResumableSampler, WindowedSampleDataset, split_by_dates
from stormshard.data.normalisation import Normaliser
from stormshard.graphs.builder import load_or_build_graph
from stormshard.models.registry import build_model
from stormshard.models.variables import VariableIndex
from stormshard.parallel.comm import all_reduce_sum, gather_tensor
from stormshard.parallel.topology import (
    BatchPlan,
    ParallelLayout,
    ProcessGroups,
    batch_arithmetic,
    build_process_groups,
)
from stormshard.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from stormshard.training.config import ConfigError, ExperimentConfig
from stormshard.training.engine import EngineSettings, build_engine
from stormshard.training.losses import AlmostFairCRPSLoss, WeightedMSELoss
from stormshard.training.metrics_log import MetricsLogger, format_table, rmse_rows

__all__ = ["Trainer", "TrainResult", "RunInputs", "preflight", "train", "RESUME_MAY_CHANGE"]

# config fields a resumed run may change (everything else must equal the checkpoint's)
RESUME_MAY_CHANGE = ("name", "training.max_steps", "training.epochs", "training.validation_interval",
                     "training.checkpoint_interval", "training.keep_checkpoints", "training.output_dir",
                     "data.graph_cache", "data.validation_samples", "logging")


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


@dataclass(frozen=True)
class RunInputs:
    """What :func:`preflight` checked and opened: everything that can fail on bad input."""

    layout: ParallelLayout
    dataset: AnemoiDataset
    variables: VariableIndex
    train_samples: WindowedSampleDataset
    val_samples: WindowedSampleDataset
    replicas: int  # independent sample streams (data-parallel replicas or ensemble groups)
    members_per_model: int  # ensemble members per model group (1 for deterministic models)
    total_steps: int
    settings: EngineSettings
    plan_batch: BatchPlan


def preflight(config: ExperimentConfig, world: int) -> RunInputs:
    """Check the config against the world size and the dataset, before any process group or file
    is made; raises :class:`ConfigError` / ``LayoutError`` / ``AnemoiLayoutError`` naming the field."""
    t = config.training
    layout = config.parallel.layout(world)
    data_path = Path(config.data.path)
    if not data_path.exists():
        raise ConfigError(
            f"data.path={config.data.path!r} does not exist: generate one with `python -m "
            "stormshard.data.synthetic --out data/synthetic.zarr` or point to an anemoi-layout dataset"
        )
    dataset = AnemoiDataset.open(data_path)
    try:
        variables = VariableIndex.build(dataset.variables, config.data.forcing, config.data.diagnostic)
    except ValueError as exc:
        raise ConfigError(f"data.forcing / data.diagnostic: {exc}") from None
    window = dict(multistep_input=config.model.multistep_input, timestep=config.data.timestep, ensemble="each")
    ranges = {"train": (config.data.train.start, config.data.train.end),
              "validation": (config.data.validation.start, config.data.validation.end)}
    try:
        train_samples = split_by_dates(dataset, {"train": ranges["train"]}, rollout=t.rollout, **window)["train"]
        val_samples = split_by_dates(dataset, {"validation": ranges["validation"]}, rollout=1, **window)["validation"]
    except ValueError as exc:
        raise ConfigError(f"data.train / data.validation / data.timestep: {exc}") from None
    if config.engine == "local" and layout.data_parallel_size > 1:
        raise ConfigError(
            f"engine='local' has no data parallelism but world {world} / gpus_per_model {layout.gpus_per_model} "
            f"gives {layout.data_parallel_size} replicas: use engine 'deepspeed' or 'ddp', or launch "
            f"{layout.gpus_per_model} processes"
        )
    if config.model.name == "ensemble":
        replicas, members = layout.num_ensemble_groups, config.parallel.ensemble_size_per_device
    else:
        replicas, members = layout.data_parallel_size, 1
    if len(train_samples) < replicas * config.micro_batch:
        raise ConfigError(
            f"data.train holds {len(train_samples)} samples, fewer than one global micro-batch "
            f"({replicas} replicas x micro batch {config.micro_batch}): widen the date range"
        )
    accumulation = config.engine_settings(1).accumulation
    per_epoch = len(train_samples) // (replicas * config.micro_batch * accumulation)
    total_steps = t.max_steps if t.max_steps is not None else max(1, per_epoch * t.epochs)
    settings = config.engine_settings(total_steps)
    plan_batch = batch_arithmetic(config.micro_batch, world, settings.accumulation, layout.gpus_per_model)
    return RunInputs(layout, dataset, variables, train_samples, val_samples, replicas, members, total_steps,
                     settings, plan_batch)


class Trainer:
    """Builds everything from an :class:`ExperimentConfig` (validated before any group or file is
    made) and runs the loop. ``torch.distributed`` must be initialised when the world is larger
    than one process (``launch/train.py`` does it)."""

    def __init__(self, config: ExperimentConfig, resume: bool = False, inputs: RunInputs | None = None) -> None:
        self.config, self.resume = config, resume
        world, self.rank = _world()
        inputs = inputs or preflight(config, world)
        self.layout, self.dataset, self.variables = inputs.layout, inputs.dataset, inputs.variables
        self.train_samples, self.val_samples = inputs.train_samples, inputs.val_samples
        self.total_steps, self.settings, self.plan_batch = inputs.total_steps, inputs.settings, inputs.plan_batch
        self.replicas, self.members_per_model = inputs.replicas, inputs.members_per_model
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
        weights = torch.ones(len(self.variables.output_names), device=self.device)
        if config.model.name == "ensemble":
            self.loss_fn = AlmostFairCRPSLoss(weights, alpha=t.crps_alpha)
        else:
            self.loss_fn = WeightedMSELoss(weights)
        self.sampler = ResumableSampler(len(self.train_samples), seed=t.seed, rank=self._replica_rank(),
                                        world_size=self.replicas)
        self.consumed = 0
        self.logger: MetricsLogger | None = None

    # ------------------------------------------------------------------ layout helpers
    def _replica_rank(self) -> int:
        if self.config.model.name == "ensemble":
            return self.groups.ensemble_data_parallel_rank
        return self.groups.data_parallel_rank

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
    def _read(self, samples: WindowedSampleDataset, indices: list[int]) -> Tensor:
        """``(batch, time, grid_local, variables)``: this rank's grid slice, normalised."""
        batch = torch.stack([samples.read(i, cells=self.plan.data_slice) for i in indices])
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

    # ------------------------------------------------------------------ the model step
    def _noise(self, batch: int, step: int, micro: int, rollout: int) -> Tensor:
        gen = torch.Generator(device=self.device)
        member = self.groups.ensemble_member_rank if self.groups.ensemble_member_group is not None else 0
        gen.manual_seed(hash((self.config.training.seed, step, micro, rollout, member, self._replica_rank()))
                        % (2**63))
        return self.engine.module.sample_noise(batch, generator=gen, dtype=self.dtype)

    def forecast_loss(self, batch: Tensor, step: int = 0, micro: int = 0) -> Tensor:
        """Mean loss over the rollout for a normalised batch ``(batch, time, grid_local, variables)``."""
        m, v = self.config.model.multistep_input, self.variables
        x = batch[:, :m][..., v.input_idx]
        members = self.members_per_model
        ensemble = self.config.model.name == "ensemble"
        if ensemble:
            x = repeat(x, "b t g v -> (b e) t g v", e=members)
        prog_in = torch.tensor(v.prognostic_in_input, device=x.device)
        prog_out = torch.tensor(v.prognostic_in_output, device=x.device)
        total = batch.new_zeros((), dtype=torch.float32)
        rollout = self.config.training.rollout
        for r in range(rollout):
            target = batch[:, m + r][..., v.output_idx].float()
            if ensemble:
                pred = self.engine(x, self._noise(x.shape[0], step, micro, r))
                ens = rearrange(pred.float(), "(b e) g v -> b e g v", e=members)
                shapes = [list(ens.shape)] * dist.get_world_size(self.groups.ensemble_member_group) \
                    if self.groups.ensemble_member_group is not None else [list(ens.shape)]
                ens = gather_tensor(ens, 1, shapes, self.groups.ensemble_member_group)
                loss = self.loss_fn(ens, target, self.area, self.groups.model_group)
            else:
                pred = self.engine(x)
                loss = self.loss_fn(pred.float(), target, self.area, self.groups.model_group)
            total = total + loss / rollout
            if r + 1 < rollout:
                forcing = batch[:, m + r][..., v.input_idx]
                if ensemble:
                    forcing = repeat(forcing, "b g v -> (b e) g v", e=members)
                nxt = forcing.index_copy(-1, prog_in, pred[..., prog_out].to(forcing.dtype))
                x = torch.cat([x[:, 1:], nxt.unsqueeze(1)], dim=1)
        return total

    # ------------------------------------------------------------------ validation
    @torch.no_grad()
    def validate(self) -> dict[str, dict[str, float]]:
        """Area-weighted RMSE per output variable (physical units) of the model and of persistence,
        over ``data.validation_samples`` windows shared out over the replicas."""
        self.engine.eval()
        v, m = self.variables, self.config.model.multistep_input
        count = min(self.config.data.validation_samples, len(self.val_samples))
        mine = list(range(self._replica_rank(), count, self.replicas))
        n_out = len(v.output_names)
        sums = torch.zeros(2 * n_out + 1, dtype=torch.float64, device=self.device)
        for i in mine:
            batch = self._read(self.val_samples, [i])
            x = batch[:, :m][..., v.input_idx]
            if self.config.model.name == "ensemble":
                pred = self.engine(x, self._noise(1, -1, i, 0))
            else:
                pred = self.engine(x)
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
        return save_checkpoint(self.output_dir / "checkpoints", step, state, self._config_dict(), self._layout_dict(),
                               self.rank, world, model=self.engine.module,
                               keep_last=self.config.training.keep_checkpoints)

    def _maybe_resume(self) -> int:
        directory = self.output_dir / "checkpoints"
        if not self.resume or latest_checkpoint(directory) is None:
            return 0
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
                step_loss = 0.0
                for micro in range(self.settings.accumulation):
                    batch = self._read(self.train_samples, self._next_indices())
                    loss = self.forecast_loss(batch, step, micro)
                    scale = self.config.ensemble_groups_factor if self.config.model.name == "ensemble" else 1
                    self.engine.backward(loss * scale)
                    self.engine.step()
                    step_loss += float(loss.detach()) / self.settings.accumulation
                mean_loss = self._replica_mean(step_loss)
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

    def _replica_mean(self, value: float) -> float:
        if self.replicas == 1 or not dist.is_initialized():
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        group = (self.groups.ensemble_data_parallel_group if self.config.model.name == "ensemble"
                 else self.groups.data_parallel_group)
        return float(all_reduce_sum(t, group)[0]) / self.replicas


def train(config: ExperimentConfig, resume: bool = False, inputs: RunInputs | None = None) -> TrainResult:
    """Build a :class:`Trainer` and run it."""
    return Trainer(config, resume=resume, inputs=inputs).fit()
