"""The training loop: config -> data, graph, sharded model, engine -> steps, validation, checkpoints.

One optimizer step (:meth:`Trainer.train_step`) runs, for each micro-batch: read (every rank of
a model group gets the same samples, but only its own slice of the grid: no all-gather of the
input; ``parallel.read_group_size`` readers per model group touch the store, see
:mod:`stormshard.data.sharded_read`; the store reads and normalisation of the next micro-batches
run ahead in ``data.num_workers`` workers, see :mod:`stormshard.data.loader`, and only the
hand-out of slices runs here), forward + loss over ``rollout`` autoregressive steps (the rollout
of the step, :mod:`stormshard.training.rollout_schedule`; the
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

from stormshard.checkpoint.format import CheckpointError, latest_checkpoint
from stormshard.checkpoint.integrity import resume_target
from stormshard.data.anemoi_layout import frequency_to_string
from stormshard.data.dataset import ResumableSampler, WindowedSampleDataset
from stormshard.data.loader import BatchKey, PrefetchLoader, SliceBatchReader, finite_keys, micro_batch_keys
from stormshard.data.normalisation import Normaliser, nan_fill_values
from stormshard.data.sharded_read import ModelSliceReader, SliceReadPlan
from stormshard.graphs.builder import load_graph, load_or_build_graph
from stormshard.models.compile import begin_graphed_step, compile_blocks, wants_compile
from stormshard.models.registry import build_model
from stormshard.parallel.comm import all_reduce_sum
from stormshard.parallel.topology import ProcessGroups, build_process_groups, rank_device
from stormshard.training.checkpoint import load_checkpoint, save_checkpoint
from stormshard.training.config import ExperimentConfig, stored_config_dump
from stormshard.training.diskspace import check_checkpoint_space
from stormshard.training.engine import build_engine
from stormshard.training.finetune import (
    TransferReport,
    check_transfer,
    freeze_parameters,
    load_init_weights,
    read_init_weights,
)
from stormshard.training.metrics_log import (
    MetricsLogger,
    drop_records_after,
    format_table,
    lead_time_rows,
    logged_keys,
    rmse_rows,
)
from stormshard.training.preflight import RESUME_MAY_CHANGE, RunInputs, checkpoint_dir, preflight
from stormshard.training.rank_zero import rank_zero_first
from stormshard.training.rollout_schedule import rollout_at
from stormshard.training.run_dir import METRICS_FILE
from stormshard.training.tasks import ForecastTask, NoiseKey, build_task
from stormshard.training.weight_averaging import AVERAGE_STATE_KEY, WeightAverage, resume_average

__all__ = ["Trainer", "TrainResult", "train"]


@dataclass
class TrainResult:
    """What a run returns on every rank."""

    losses: list[float] = field(default_factory=list)  # per optimizer step, mean over replicas
    # {"rmse": {var: x}, "persistence": {var: x}} at the first lead time, plus "rmse_by_lead" /
    # "persistence_by_lead": {lead: {var: x}} for every lead time of training.validation_rollout
    validation: dict[str, dict[str, Any]] = field(default_factory=dict)
    test: dict[str, dict[str, Any]] = field(default_factory=dict)  # the same for data.test, when given
    rollouts: list[int] = field(default_factory=list)  # the rollout of each optimizer step
    data_wait: float = 0.0  # seconds the training loop waited for input data in total
    checkpoint: str | None = None
    output_dir: str = ""


def _world() -> tuple[int, int]:
    if dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


@dataclass
class _PendingStep:
    """A trained step whose loss (a device tensor) is read later: :meth:`Trainer.fit` on CUDA."""

    step: int
    started: float  # time.perf_counter() at the step's start
    waited: float  # the trainer's data wait before the step
    loss: Tensor | None = None
    lr: float = float("nan")
    host: Tensor | None = None  # the loss copied to the host without waiting (CUDA), valid once ``ready`` is
    ready: Any = None  # a torch.cuda.Event recorded after that copy: waiting on it waits for this step only

    def hand_over(self) -> None:
        """Queue the loss's copy to the host and an event behind it (on CUDA; elsewhere nothing)."""
        if self.loss is not None and self.loss.is_cuda:
            self.host = self.loss.to("cpu", non_blocking=True)
            self.ready = torch.cuda.Event()
            self.ready.record()

    def value(self) -> float:
        """The loss as a float: waits for this step's kernels only (not for steps queued after it)."""
        if self.ready is not None:
            self.ready.synchronize()
            return float(self.host)
        return float(self.loss)


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
        self.device = rank_device()
        self.graph = self._graph()
        torch.manual_seed(t.seed)
        model = build_model(config.model, self.graph, self.variables, self.groups.model_group,
                            shard_strategy=config.parallel.shard_strategy).to(self.device)
        self.transfer: TransferReport | None = None  # what training.init_weights set (not on resume)
        if t.init_weights and not resume:  # read by the preflight (once), matched against these shapes too
            full = inputs.init_weights.take() if inputs.init_weights is not None else read_init_weights(t.init_weights)
            self.transfer = load_init_weights(model, full, t.init_weights)
            del full
            check_transfer(self.transfer, t.init_weights_partial)  # shapes that depend on the graph, now known
        self.frozen = freeze_parameters(model, list(t.freeze))  # before the engine: it optimises the others
        self.plan = model.plan
        if wants_compile(t.compile, self.device.type):  # per block, after parallelize and checkpointing, before
            # the engine wraps it (torchtitan's order)
            compile_blocks(model, cuda_graphs=t.cuda_graphs)
        self.graphed = t.cuda_graphs  # steps and validation batches are marked for the CUDA graph trees
        self.engine = build_engine(model, self.groups, self.settings)
        # training.weight_averaging: this rank's fp32 average of its parameters (after the engine placed them)
        self.average = (WeightAverage(t.weight_averaging, self.engine.module, self.engine.fp32_master_views())
                        if t.weight_averaging else None)
        self.dtype = torch.float32  # data, targets, loss and ensemble noise at every training.precision

        stats, names = self.dataset.statistics, self.dataset.variables
        methods = dict(config.data.normalisation_methods)
        self.normaliser = Normaliser.from_statistics(stats, names, methods=methods,
                                                     default=config.data.normalisation).to(self.device)
        self.output_normaliser = Normaliser.from_statistics(stats, names, variables=self.variables.output_names,
                                                            methods=methods, default=config.data.normalisation
                                                            ).to(self.device)
        self.area = self.graph["data"].area_weight[self.plan.data_slice].to(self.device, torch.float32)
        input_normaliser = Normaliser.from_statistics(stats, names, variables=self.variables.input_names,
                                                      methods=methods, default=config.data.normalisation)
        self.input_fill = nan_fill_values(stats, names, input_normaliser, config.data.imputation)
        self.loss_weights = inputs.loss_weights or None
        self.test_samples, self.steps_per_epoch, self.notes = inputs.test_samples, inputs.steps_per_epoch, inputs.notes
        if self.transfer is not None:
            self.notes = (*self.notes, self.transfer.lines())
        if self.frozen:
            self.notes = (*self.notes, f"freeze: {len(self.frozen)} parameters not trained (training.freeze="
                                       f"{list(t.freeze)})")
        self.task: ForecastTask = build_task(config, self.groups, self.variables, self.area, model, self.dtype,
                                             loss_weights=self.loss_weights, input_fill=self.input_fill)
        self.replicas = self.task.replicas
        self.reader = ModelSliceReader(
            SliceReadPlan(tuple(self.plan.data_sizes), self.layout.read_group_size, self.plan.rank),
            self.groups.model_group, self.device)
        self.sampler = ResumableSampler(len(self.train_samples), seed=t.seed, rank=self.task.replica_rank,
                                        world_size=self.replicas)
        self.logger: MetricsLogger | None = None
        self._keys = None  # the micro-batch key stream (data/loader.py), from the sampler's state
        self._loader: PrefetchLoader | None = None
        self._last_key: BatchKey | None = None  # the last micro-batch used: the checkpointed data position
        self._start_step = 0
        self.resumed_from: Path | None = None  # the checkpoint a resumed run continues
        self._prepared: int | None = None  # the step training starts at, once :meth:`prepare` ran

    def _graph(self):  # noqa: ANN202
        if self.config.data.graph_file:  # fixed (an imported model's): used as it is, never rebuilt
            return load_graph(self.config.data.graph_file)
        cache = Path(self.config.data.graph_cache or self.output_dir / "graph.pt")
        latlon = (self.dataset.latitudes, self.dataset.longitudes) if self.config.graph.data_grid is None else None
        # rank 0 builds and caches it (its phases printed with logging.progress), then the others load
        # it; a failure on rank 0 ends every rank
        progress = self.config.logging.progress and self.rank == 0
        return rank_zero_first(lambda: load_or_build_graph(self.config.graph, cache, data_latlon=latlon,
                                                           progress=progress, isolate=True),
                               f"building the graph {cache}")

    # ------------------------------------------------------------------ data
    def read_batch(self, samples: WindowedSampleDataset, indices: list[int], times: int | None = None) -> Tensor:
        """``(batch, time, grid_local, variables)``: this rank's grid slice of samples ``indices``
        (their first ``times`` dates; None = whole windows), normalised, read here (no prefetch).
        Every rank of the model group calls it with the same indices (the readers of
        ``parallel.read_group_size`` hand the other ranks their slices). NaNs of the store stay."""
        key = BatchKey(tuple(indices), times or len(samples.offsets), -1, 0, 0, 0)
        block = self._slice_reader(samples)(key) if self.reader.plan.is_reader else None
        return self._hand_out(samples, key, block)

    def _slice_reader(self, samples: WindowedSampleDataset) -> SliceBatchReader:
        """The worker-side read of this (reader) rank: its clients' cells, normalised in float64."""
        out = torch.float64 if self.dtype == torch.float64 else torch.float32
        return SliceBatchReader(samples, self.reader.plan.read_cells, self.normaliser.offset, self.normaliser.scale,
                                out_dtype=out)

    def _hand_out(self, samples: WindowedSampleDataset, key: BatchKey, block: Tensor | None) -> Tensor:
        """This rank's slice on the device from the reader's block (the model-group communication)."""
        shape = (len(key.indices), key.times, *samples.sample_shape[1:])
        dtype = torch.float64 if self.dtype == torch.float64 else torch.float32
        batch = self.reader.distribute(block, shape, dtype, non_blocking=self.device.type == "cuda")
        return batch.float() if batch.dtype != torch.float64 else batch  # fp32 at any precision

    def _times_at(self, step: int) -> int:
        return self.config.model.multistep_input + self.rollout_at(step)

    def rollout_at(self, step: int) -> int:
        """The rollout of optimizer step ``step`` (``training.rollout``, an int or a schedule)."""
        return rollout_at(step, self.config.training.rollout, self.steps_per_epoch)

    def _key_stream(self):  # noqa: ANN202
        if self._keys is None:
            self._keys = micro_batch_keys(self.sampler, self.config.micro_batch, self.settings.accumulation,
                                          self._start_step, self._times_at)
        return self._keys

    def _next_indices(self) -> list[int]:
        """The sample indices of the next micro-batch (no read; for callers that read themselves)."""
        key = next(self._key_stream())
        self._last_key = key
        return list(key.indices)

    def _open_loader(self) -> PrefetchLoader:
        d = self.config.data
        read = self._slice_reader(self.train_samples) if self.reader.plan.is_reader else None
        return PrefetchLoader(self._key_stream(), read, num_workers=d.num_workers, prefetch=d.prefetch,
                              worker_type=d.worker_type, pin_memory=self.device.type == "cuda")

    def next_batch(self) -> tuple[BatchKey, Tensor]:
        """The next training micro-batch ``(batch, multistep_input + rollout, grid_local, variables)``
        and its key; its store read ran ahead in the loader's workers."""
        if self._loader is None:
            self._loader = self._open_loader()
        key, block = next(self._loader)
        if self.reader.plan.is_reader:
            self.reader.store_reads += len(key.indices)
        tic = time.perf_counter()
        batch = self._hand_out(self.train_samples, key, block)
        self._loader.wait_time += time.perf_counter() - tic
        self._last_key = key
        return key, batch

    @property
    def data_wait(self) -> float:
        """Seconds this rank has waited for input data (prefetch misses and the hand-out)."""
        return 0.0 if self._loader is None else self._loader.wait_time

    def close(self) -> None:
        """Stop the loader's workers."""
        if self._loader is not None:
            self._loader.close()
            self._loader = None

    # ------------------------------------------------------------------ the training step
    def train_step(self, step: int) -> Tensor:
        """One optimizer step; returns its loss, averaged over micro-batches and replicas, as a 0-dim
        float64 tensor on the device (reading it, ``float(...)``, waits for the step's kernels: :meth:`fit`
        reads it one step later on CUDA, so that the device never idles while the host catches up)."""
        if self.graphed:  # the previous step's graph outputs may be overwritten from here (its gradients were freed)
            begin_graphed_step()
        step_loss = torch.zeros((), dtype=torch.float64, device=self.device)
        for micro in range(self.settings.accumulation):
            key, batch = self.next_batch()                                        # read (prefetched)
            if (key.step, key.micro) != (step, micro):
                raise RuntimeError(f"the data stream is at step {key.step} micro {key.micro} but the loop at step "
                                   f"{step} micro {micro}: call train_step once per step, in order")
            loss = self.task.forecast_loss(self.engine, batch, step, micro)       # forward + loss (rollout)
            self.engine.backward(loss * self.task.loss_scale)                     # backward
            skipped = self.engine.skipped_steps
            stepped = self.engine.step() and self.engine.skipped_steps == skipped  # step (at the boundary)
            step_loss += loss.detach().double() / self.settings.accumulation
        if self.average is not None:  # an optimizer step the engine skipped (non-finite gradients) is no update
            self.average.update(step, stepped)
        return self._replica_mean(step_loss)

    def _replica_mean(self, value: Tensor) -> Tensor:
        """The mean of the 0-dim ``value`` over the replicas (an all-reduce of 8 bytes; no host sync)."""
        if self.replicas == 1 or not dist.is_initialized():
            return value
        return all_reduce_sum(value.reshape(1), self.task.replica_group)[0] / self.replicas

    # ------------------------------------------------------------------ validation
    def lead_times(self, samples: WindowedSampleDataset) -> list[str]:
        """Labels of the lead times of ``samples``' windows: ``["6h", "12h", ...]``."""
        return [frequency_to_string(samples.timestep * (r + 1)) for r in range(samples.rollout)]

    def validate(self, samples: WindowedSampleDataset | None = None, count: int | None = None) -> dict[str, dict[str, Any]]:
        """:meth:`validate_weights` of the averaged weights (``training.weight_averaging``; swapped in, then the
        trained ones back bit for bit, as Lightning's weight averaging validates), else of the trained ones; the
        result's ``"averaged"`` says which (``{"kind", "updates"}``, or empty)."""
        if self.average is None:
            return {**self.validate_weights(samples, count), "averaged": {}}
        with self.average.swapped_in():
            metrics = self.validate_weights(samples, count)
        return {**metrics, "averaged": {"kind": self.average.settings.kind, "updates": self.average.updates}}

    @torch.no_grad()
    def validate_weights(self, samples: WindowedSampleDataset | None = None,
                         count: int | None = None) -> dict[str, dict[str, Any]]:
        """Area-weighted RMSE per output variable (physical units) and lead time of the model's
        rollout (``training.validation_rollout`` steps) and of persistence (the initial state), over
        ``count`` windows of ``samples`` (default: ``data.validation_samples`` validation windows)
        shared out over the replicas. Missing truth (NaN) is skipped: each RMSE is over the valid cells.

        Returns ``{"rmse": {var: x}, "persistence": {var: x}}`` at the first lead time and
        ``"rmse_by_lead"`` / ``"persistence_by_lead"``: ``{lead: {var: x}}``.
        Communicates: one all-reduce of ``(leads, 3, outputs)`` float64 sums over the world.
        """
        samples = self.val_samples if samples is None else samples
        count = min(self.config.data.validation_samples if count is None else count, len(samples))
        self.engine.eval()
        v, m = self.variables, self.config.model.multistep_input
        leads = self.lead_times(samples)
        mine = list(range(self.task.replica_rank, count, self.replicas))
        n_out = len(v.output_names)
        sums = torch.zeros(len(leads), 3, n_out, dtype=torch.float64, device=self.device)
        d = self.config.data
        read = self._slice_reader(samples) if self.reader.plan.is_reader else None
        keys = finite_keys(mine, 1, m + len(leads))
        a = self.area.double()[None, :, None]
        with PrefetchLoader(keys, read, num_workers=d.num_workers, prefetch=d.prefetch, worker_type="threads",
                            pin_memory=self.device.type == "cuda") as loader:
            for key, block in loader:
                batch = self._hand_out(samples, key, block)
                if self.graphed:
                    begin_graphed_step()
                preds = self.task.predict_rollout(self.engine, batch, NoiseKey(step=-1, micro=key.indices[0]))
                persist = self.output_normaliser.denormalise(batch[:, m - 1][..., v.output_idx].double())
                for r, pred in enumerate(preds):
                    truth = self.output_normaliser.denormalise(batch[:, m + r][..., v.output_idx].double())
                    model = self.output_normaliser.denormalise(pred.double())
                    valid = ~(torch.isnan(truth) | torch.isnan(persist))
                    zero = torch.zeros((), dtype=torch.float64, device=self.device)
                    sums[r, 0] += (torch.where(valid, (model - truth) ** 2, zero) * a).sum(dim=(0, 1))
                    sums[r, 1] += (torch.where(valid, (persist - truth) ** 2, zero) * a).sum(dim=(0, 1))
                    sums[r, 2] += (valid * a).sum(dim=(0, 1))
        if dist.is_initialized():
            dist.all_reduce(sums)
        self.engine.train()
        denom = sums[:, 2].clamp_min(1e-300)
        rmse, pers = (sums[:, 0] / denom).sqrt().tolist(), (sums[:, 1] / denom).sqrt().tolist()
        by_lead = {lead: dict(zip(v.output_names, rmse[r], strict=True)) for r, lead in enumerate(leads)}
        pers_by_lead = {lead: dict(zip(v.output_names, pers[r], strict=True)) for r, lead in enumerate(leads)}
        return {"rmse": by_lead[leads[0]], "persistence": pers_by_lead[leads[0]],
                "rmse_by_lead": by_lead, "persistence_by_lead": pers_by_lead}

    @staticmethod
    def validation_metrics(metrics: dict[str, dict[str, Any]], prefix: str = "val") -> dict[str, float]:
        """Flat metrics for the log: ``{prefix}_rmse/<var>`` (first lead, as before) and
        ``{prefix}_rmse/<var>/<lead>``, ``{prefix}_persistence/<var>/<lead>`` for every lead."""
        out = {f"{prefix}_rmse/{k}": x for k, x in metrics["rmse"].items()}
        for lead, values in metrics["rmse_by_lead"].items():
            out.update({f"{prefix}_rmse/{k}/{lead}": x for k, x in values.items()})
        for lead, values in metrics["persistence_by_lead"].items():
            out.update({f"{prefix}_persistence/{k}/{lead}": x for k, x in values.items()})
        if metrics.get("averaged"):  # validated with the weight average: how many updates it holds
            out[f"{prefix}_averaged_weights_updates"] = metrics["averaged"]["updates"]
        return out

    def validation_table(self, metrics: dict[str, dict[str, Any]]) -> str:
        """The end-of-run table: one row per variable, or per variable and lead time."""
        if len(metrics["rmse_by_lead"]) == 1:
            return format_table(rmse_rows(metrics["rmse"], metrics["persistence"]))
        return format_table(lead_time_rows(metrics["rmse_by_lead"], metrics["persistence_by_lead"]))

    # ------------------------------------------------------------------ checkpoints
    def _config_dict(self) -> dict[str, Any]:
        return self.config.model_dump(mode="json")

    def _layout_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self.layout)

    def data_state(self) -> dict[str, int]:
        """The sampler position after the last micro-batch *used* (not the ones read ahead)."""
        state = self.sampler.state_dict()
        if self._last_key is not None:
            state.update(epoch=self._last_key.epoch, position=self._last_key.position)
        return state

    def check_checkpoint_space(self, step: int) -> None:
        """Stop (every rank, :class:`~stormshard.training.diskspace.DiskSpaceError`) when the checkpoint
        directory has no room for the checkpoint of ``step`` (:mod:`stormshard.training.diskspace`)."""
        zero = self.settings.zero_stage if self.config.engine == "deepspeed" else 0
        last = latest_checkpoint(checkpoint_dir(self.config))
        check_checkpoint_space(checkpoint_dir(self.config), self.engine.module, step,
                               zero_partitions=self.layout.data_parallel_size if zero > 0 else 1,
                               device=self.device, last_checkpoint=None if last is None else str(last),
                               extra_bytes=0 if self.average is None else self.average.nbytes)

    def save(self, step: int) -> Path:
        self.check_checkpoint_space(step)  # before anything of this checkpoint is written
        state = {"engine": self.engine.state_dict(), "data": self.data_state(), "step": step}
        if self.average is not None:
            state[AVERAGE_STATE_KEY] = self.average.state_dict()
        world, _ = _world()
        return save_checkpoint(checkpoint_dir(self.config), step, state, self._config_dict(), self._layout_dict(),
                               self.rank, world, model=self.engine.module,
                               keep_last=self.config.training.keep_checkpoints)

    def _maybe_resume(self) -> int:
        if not self.resume:
            return 0
        world, _ = _world()  # preflight checked the checkpoint `latest` names (resume_target: the same one here)
        found = resume_target(checkpoint_dir(self.config))
        if found is None:
            raise CheckpointError(f"{checkpoint_dir(self.config)} holds no checkpoint any more: nothing to resume")
        loaded = load_checkpoint(checkpoint_dir(self.config), self.rank, path=found.path, config=self._config_dict(),
                                 layout=self._layout_dict(),
                                 world=world, ignore=RESUME_MAY_CHANGE, read_stored_config=stored_config_dump)
        self.resumed_from = loaded.path  # printed by fit
        self.engine.load_state_dict(loaded.state["engine"])
        self.sampler.load_state_dict(loaded.state["data"])
        self.notes = (*self.notes, *resume_average(self.average, loaded.state.get(AVERAGE_STATE_KEY)))
        self._keys, self._last_key = None, None  # the key stream restarts from the restored position
        return int(loaded.state["step"])

    def prepare(self) -> int:
        """What can still stop the run once it is built, before it writes anything (``run_training`` calls it
        before ``config.json`` is written; :meth:`fit` when not called yet): at ``--resume`` the checkpoint is
        loaded (config, layout, every rank's files checked), and the checkpoint directory has room for the
        first checkpoint this run saves (none when a resumed run has nothing left to train). Collective;
        returns the step training starts at."""
        if self._prepared is None:
            start, t = self._maybe_resume(), self.config.training
            if start < self.total_steps:  # no step is trained that could not be saved
                self.check_checkpoint_space(min(self.total_steps,
                                                (start // t.checkpoint_interval + 1) * t.checkpoint_interval))
            self._prepared = start
        return self._prepared

    # ------------------------------------------------------------------ the loop
    def non_finite_message(self, loss: float, step: int) -> str:
        """Why the loss is not finite. NaNs of the data are imputed and masked, so they cannot cause
        it; a target with no valid point at all gives 0, not NaN. What is left is the model."""
        return (f"the loss became {loss} at step {step} (rollout {self.rollout_at(step)}); missing values in the "
                "data cannot cause it (NaN inputs are imputed and NaN targets masked), so the model diverged: lower "
                f"training.lr (now {self.config.training.lr}), set training.gradient_clipping (now "
                f"{self.config.training.gradient_clipping}) or lengthen training.warmup_steps")

    @property
    def read_loss_late(self) -> bool:
        """Whether :meth:`fit` reads a step's loss after queueing the next step: on CUDA (the loss is copied to
        the host behind an event when its step is queued, and the read waits for that event, i.e. for that
        step only, while the next step runs: the device never waits for the host between steps), not on a
        CPU (its work is done when queued)."""
        return self.device.type == "cuda"

    def _record_step(self, done: _PendingStep, result: TrainResult, samples_per_step: int,
                     after: _PendingStep | None = None) -> None:
        """Read a step's loss (a host sync on this step only), check it is finite, append it and log it. ``after``:
        the step queued after it, whose start ends this one's step time and data wait (a step read late)."""
        lg = self.config.logging
        mean_loss = done.value()
        if not math.isfinite(mean_loss):
            raise FloatingPointError(self.non_finite_message(mean_loss, done.step))
        result.losses.append(mean_loss)
        result.rollouts.append(self.rollout_at(done.step))
        if (done.step + 1) % lg.log_interval == 0 or done.step + 1 == self.total_steps:
            self.logger.log(done.step + 1, {"loss": mean_loss, "rollout": self.rollout_at(done.step),
                                            "lr": done.lr,
                                            "step_time": (after.started if after else time.perf_counter())
                                            - done.started,
                                            "data_wait": (after.waited if after else self.data_wait) - done.waited},
                            samples=samples_per_step * lg.log_interval)

    def _weights_note(self) -> str:
        """What validation ran with, for its log lines: empty for the trained weights."""
        return "" if self.average is None else f"; the averaged weights: {self.average.describe()}"

    def describe(self) -> str:
        b = self.plan_batch
        return (f"layout: {self.layout.describe()}\n"
                f"batch:  {b.describe()}\n"
                f"model:  {self.config.model.name}"
                f"{'' if self.config.model.uses_graph_processor else ' (' + self.plan.shard_strategy + ')'}, "
                f"{sum(p.numel() for p in self.engine.module.parameters()):,} parameters on this rank; "
                f"grid {self.plan.num_data} cells ({self.plan.data_sizes[self.plan.rank]} here), hidden "
                f"{self.plan.num_hidden} nodes; engine {self.config.engine} on {self.device}")

    def fit(self) -> TrainResult:
        """Resume if asked, run the steps with logging, validation and checkpoints, validate at the end."""
        t, lg = self.config.training, self.config.logging
        start = self.prepare()
        self._start_step = start
        if self.resume and self.rank == 0:  # the steps after the checkpoint are trained again: their old records go
            drop_records_after(self.output_dir / METRICS_FILE, start)
        result = TrainResult(output_dir=str(self.output_dir))
        self.logger = MetricsLogger(self.output_dir, rank=self.rank, total_steps=self.total_steps,
                                    initial_step=start, progress=lg.progress, wandb=lg.wandb,
                                    wandb_mode=lg.wandb_mode, project=lg.project, run_name=self.config.name,
                                    config=self._config_dict(), every_s=lg.log_every_s)
        self.logger.write(self.describe())
        if self.resume:
            self.logger.write(f"resumed from step {start} ({self.resumed_from})")
        for note in self.notes:
            self.logger.write(note)
        self.engine.train()
        samples_per_step = self.plan_batch.effective_batch
        last_saved = None
        # on CUDA a step's loss is read after the next step is queued (reading it waits for its kernels);
        # never across a validation, a checkpoint or the end, so nothing is saved before its loss is checked
        defer = self.read_loss_late
        pending: _PendingStep | None = None
        try:
            for step in range(start, self.total_steps):
                queued = _PendingStep(step, time.perf_counter(), self.data_wait)
                try:
                    queued.loss = self.train_step(step)
                except BaseException:
                    if pending is not None:  # the step before is not lost (its NaN is the clearer error)
                        self._record_step(pending, result, samples_per_step, after=queued)
                    raise
                queued.lr = self.engine.lr  # after the step, as logged before
                if pending is not None:
                    self._record_step(pending, result, samples_per_step, after=queued)
                boundary = (step + 1) % t.validation_interval == 0 or (step + 1) % t.checkpoint_interval == 0 \
                    or step + 1 == self.total_steps
                pending = queued if defer and not boundary else None
                if pending is not None:
                    pending.hand_over()
                else:
                    self._record_step(queued, result, samples_per_step)
                if (step + 1) % t.validation_interval == 0 and step + 1 < self.total_steps:
                    metrics = self.validate()
                    self.logger.log(step + 1, self.validation_metrics(metrics))
                    count = min(self.config.data.validation_samples, len(self.val_samples))
                    self.logger.write(f"validation RMSE against persistence at step {step + 1} ({count} windows"
                                      f"{self._weights_note()}):\n"
                                      f"{self.validation_table(metrics)}")
                if (step + 1) % t.checkpoint_interval == 0:
                    last_saved = self.save(step + 1)
                    self.logger.write(f"checkpoint saved: {last_saved}")
            finished_before = self.resume and start >= self.total_steps  # resumed a run that had ended
            logged: set[str] | None = None  # what a finished run logged at its last step (its final validation)
            if finished_before:
                last_saved = Path(str(self.resumed_from))
                if self.rank == 0 and start == self.total_steps:  # (a lowered max_steps: nothing is logged)
                    logged = logged_keys(self.output_dir / METRICS_FILE, self.total_steps)
                self.logger.write(f"the run had already trained its {self.total_steps} steps: nothing to train "
                                  "(raise training.max_steps to continue); validating the checkpoint, its metrics "
                                  "records kept as they are")
            elif last_saved is None or int(last_saved.name.split("_")[-1]) != self.total_steps:
                last_saved = self.save(self.total_steps)
                self.logger.write(f"checkpoint saved: {last_saved}")
            result.checkpoint = str(last_saved)
            result.data_wait = self.data_wait
            result.validation = self.validate()
            metrics = self.validation_metrics(result.validation)
            if not finished_before or _never_logged(logged, "val_rmse/"):  # once: a finished run killed in its
                self.logger.log(self.total_steps, metrics)  # final validation (before logging it) logs it now
            table = self.validation_table(result.validation)
            count = min(self.config.data.validation_samples, len(self.val_samples))
            self.logger.write(f"\nvalidation RMSE against persistence ({count} windows{self._weights_note()}):\n{table}")
            if self.test_samples is not None:
                count = min(self.config.data.validation_samples, len(self.test_samples))
                result.test = self.validate(self.test_samples)
                metrics = self.validation_metrics(result.test, prefix="test")
                if not finished_before or _never_logged(logged, "test_rmse/"):
                    self.logger.log(self.total_steps, metrics)
                self.logger.write(f"\ntest RMSE against persistence ({count} windows of data.test):\n"
                                  f"{self.validation_table(result.test)}")
            self.logger.write(f"checkpoint: {last_saved}\nmetrics:    {self.output_dir / 'metrics.jsonl'}")
        finally:
            self.close()
            self.logger.close()
        return result


def _never_logged(logged: set[str] | None, prefix: str) -> bool:
    """Whether the metric names ``logged`` (None: not looked at) hold none starting with ``prefix``."""
    return logged is not None and not any(k.startswith(prefix) for k in logged)


def train(config: ExperimentConfig, resume: bool = False, inputs: RunInputs | None = None) -> TrainResult:
    """Build a :class:`Trainer` and run it."""
    return Trainer(config, resume=resume, inputs=inputs).fit()
