"""PowerSGD gradient compression over a data-parallel group, with batched factor all-reduces.

Every gradient ``G`` of a parameter with at least two dimensions is viewed as a matrix
``(rows, cols) = (shape[0], prod(shape[1:]))``. One step (after ``start_iter``) on each rank:

1. ``M = G + E`` (``E``: this rank's error-feedback buffer, zero at first);
2. ``P = M Q`` ``(rows, r)``, all-reduced to the group mean, then orthonormalised (Gram-Schmidt);
3. ``Q^T = P^T M`` (stored as ``(r, cols)``), all-reduced to the group mean (kept as next step's
   warm start);
4. ``G <- P Q^T`` (the mean gradient projected on ``span(P)``), ``E <- M - P Q^T``.

What is communicated per step, whatever the number of parameters:

- one all-reduce of the P factors of *all* compressed matrices (one flat buffer);
- one all-reduce of the Q factors of all compressed matrices (one flat buffer);
- one all-reduce of every uncompressed gradient (1-D, fewer than ``min_numel`` elements, or a
  matrix where ``rows * cols < min_compression_rate * (rows + cols) * r``), flattened into one
  buffer. With ``overlap=True`` it is launched asynchronously first and runs while P and Q are
  computed and reduced.

So a step costs 3 all-reduce calls (fewer when a bucket is empty) and, per compressed matrix,
``(rows + cols) * r`` elements instead of ``rows * cols``. Before ``start_iter`` every gradient goes
through one exact flat all-reduce. Every call reports to :class:`~stormshard.parallel.counter.CommCounter`
as kind ``"all_reduce"``.

The settings and the plan (which matrices are compressed, where their factors live) are in
:mod:`stormshard.parallel.compression_plan` (re-exported here); the all-reduces and their byte
counts are :func:`stormshard.parallel.comm.all_reduce_`.

Entry points:

- :class:`PowerSGDCompressor`: ``reduce_gradients()`` after backward (DeepSpeed with
  ``engine.enable_backward_allreduce = False`` at ZeRO 0, or any list of parameters with ``.grad``);
- :func:`exact_allreduce_gradients`: the uncompressed baseline (one flat all-reduce, mean);
- :func:`register_powersgd_hook`: the same compressor as a torch DDP communication hook.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from stormshard.parallel.comm import all_reduce_, ring_all_reduce_bytes
from stormshard.parallel.compression_plan import (
    CompressionPlan,
    MatrixEntry,
    PowerSGDConfig,
    StepBytes,
    make_plan,
)
from stormshard.parallel.grads import all_reduce_flat_
from stormshard.parallel.partition import get_partition
from stormshard.parallel.shapes import group_size

__all__ = [
    "PowerSGDConfig",
    "PowerSGDCompressor",
    "CompressionPlan",
    "MatrixEntry",
    "StepBytes",
    "make_plan",
    "exact_allreduce_gradients",
    "PowerSGDHookState",
    "powersgd_ddp_hook",
    "register_powersgd_hook",
]

ProcessGroup = dist.ProcessGroup
ParamsArg = Iterable[nn.Parameter] | Iterable[tuple[str, nn.Parameter]]


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _named(params: ParamsArg) -> list[tuple[str, Tensor]]:
    """``(name, param)`` pairs from parameters or named parameters; trainable ones only."""
    out: list[tuple[str, Tensor]] = []
    for i, item in enumerate(params):
        if isinstance(item, tuple):
            if len(item) != 2 or not isinstance(item[0], str) or not isinstance(item[1], Tensor):
                raise TypeError(f"params[{i}] must be a Parameter or a (name, Parameter) pair, got {item!r}")
            name, p = item
        elif isinstance(item, Tensor):
            name, p = f"param{i}", item
        else:
            raise TypeError(
                f"params[{i}] must be a Parameter or a (name, Parameter) pair, got {type(item).__name__}: "
                "pass model.parameters() or model.named_parameters()"
            )
        if p.requires_grad:
            out.append((name, p))
    return out


def _collect_grads(named: Sequence[tuple[str, Tensor]], allow_missing: bool) -> list[Tensor]:
    grads = []
    for name, p in named:
        if p.grad is None:
            if not allow_missing:
                raise ValueError(
                    f"parameter {name!r} has no gradient: every rank must hold a .grad for every parameter "
                    "before the reduction (call optimizer.zero_grad(set_to_none=False), or pass "
                    "allow_missing_grads=True to count a missing gradient as zeros)"
                )
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def _exact_mean(grads: Sequence[Tensor], group: ProcessGroup | None, async_op: bool):
    """Flatten ``grads`` into one buffer and start its all-reduce. Returns a finisher that waits,
    divides by the group size and copies the mean back into ``grads``."""
    world = group_size(group)
    if not grads or world == 1:
        return lambda: None
    flat = torch.cat([g.reshape(-1) for g in grads])
    work = all_reduce_(flat, group, async_op=async_op)

    def finish() -> None:
        if work is not None and async_op:
            work.wait()
        flat.div_(world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    return finish


def exact_allreduce_gradients(params: ParamsArg, group: ProcessGroup | None, allow_missing_grads: bool = False) -> None:
    """Replace every ``param.grad`` by its mean over ``group``: one flat all-reduce per gradient dtype.

    Communicates: one all-reduce of all gradients (flattened), per dtype/device present.
    """
    named = _named(params)
    grads = _collect_grads(named, allow_missing_grads)
    buckets: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for g in grads:
        buckets.setdefault((g.dtype, g.device), []).append(g)
    for bucket in buckets.values():
        _exact_mean(bucket, group, async_op=False)()


def _orthonormalise_(p: Tensor, eps: float) -> None:
    """Gram-Schmidt on the columns of a batch ``(k, rows, r)`` in place (twice, for stability);
    a column of norm below ``eps`` is divided by ``eps`` (a zero column stays zero)."""
    work = p if p.dtype in (torch.float32, torch.float64) else p.float()
    for _ in range(2):
        for i in range(work.shape[-1]):
            col = work[:, :, i : i + 1]
            if i > 0:
                prev = work[:, :, :i]
                col -= prev @ (prev.transpose(1, 2) @ col)
            col /= col.norm(dim=1, keepdim=True).clamp_min(eps)
    if work is not p:
        p.copy_(work)


# --------------------------------------------------------------------------------------------
# the compressor
# --------------------------------------------------------------------------------------------


class PowerSGDCompressor:
    """PowerSGD over a data-parallel group: ``reduce_gradients()`` replaces each ``param.grad`` by
    the group mean (exact for uncompressed tensors, rank-``r`` approximation for compressed ones).

    All parameters must share one dtype and device (build one compressor per dtype otherwise);
    frozen parameters (``requires_grad=False``) are skipped. State (step, Q factors, error
    buffers) is per parameter, so ``state_dict()`` / ``load_state_dict()`` resume exactly.
    """

    def __init__(
        self,
        params: ParamsArg,
        group: ProcessGroup | None,
        config: PowerSGDConfig | None = None,
        allow_missing_grads: bool = False,
    ) -> None:
        config = PowerSGDConfig() if config is None else config
        if not isinstance(config, PowerSGDConfig):
            raise TypeError(f"config must be a PowerSGDConfig, got {type(config).__name__}")
        self.config = config
        self.group = group
        self.allow_missing_grads = allow_missing_grads
        self.named_params = _named(params)
        if not self.named_params:
            raise ValueError("params holds no trainable parameter: pass model.parameters() of a model that trains")
        first_name, first = self.named_params[0]
        for name, p in self.named_params[1:]:
            if p.dtype != first.dtype or p.device != first.device:
                raise ValueError(
                    f"parameter {name!r} is {p.dtype} on {p.device} but {first_name!r} is {first.dtype} on "
                    f"{first.device}: one compressor handles one dtype and device; build one per dtype"
                )
        self.plan = make_plan([n for n, _ in self.named_params], [tuple(p.shape) for _, p in self.named_params], config)
        self.step = 0
        self._q = first.new_zeros(self.plan.q_numel)  # zero columns are redrawn at random on first use
        self._error = first.new_zeros(self.plan.error_numel)

    # ---------------------------------------------------------------- public
    def reduce_gradients(self) -> None:
        """Replace every ``param.grad`` by its (approximate, for compressed matrices) group mean.

        Communicates: at most 3 all-reduces (uncompressed bucket, P factors, Q factors); before
        ``start_iter`` a single exact all-reduce.
        """
        self.reduce_tensors(_collect_grads(self.named_params, self.allow_missing_grads))

    def reduce_tensors(self, grads: Sequence[Tensor]) -> None:
        """Like :meth:`reduce_gradients` on explicit gradient tensors, one per parameter, in order (in place)."""
        if len(grads) != len(self.plan.entries):
            raise ValueError(f"expected {len(self.plan.entries)} gradients (one per parameter), got {len(grads)}")
        for e, g in zip(self.plan.entries, grads, strict=True):
            if tuple(g.shape) != e.shape:
                raise ValueError(f"gradient of {e.name!r} has shape {tuple(g.shape)}, expected {e.shape}")
        step = self.step
        self.step += 1
        if step < self.config.start_iter or not self.plan.compressed:
            _exact_mean(list(grads), self.group, async_op=False)()
            return
        ref = grads[0]
        if self._q.dtype != ref.dtype or self._q.device != ref.device:
            self._q = self._q.to(device=ref.device, dtype=ref.dtype)
            self._error = self._error.to(device=ref.device, dtype=ref.dtype)
        finish_exact = _exact_mean([grads[e.index] for e in self.plan.uncompressed], self.group, self.config.overlap)
        self._compress(grads, step)
        finish_exact()

    def bytes_per_step(self, element_size: int | None = None) -> StepBytes:
        """Bytes this rank sends per step after ``start_iter`` with PowerSGD and with exact all-reduce."""
        world = group_size(self.group)
        size = self._q.element_size() if element_size is None else element_size
        plan = self.plan
        buckets = [n for n in (plan.exact_numel, plan.p_numel, plan.q_numel) if n > 0]
        compressed = sum(ring_all_reduce_bytes(n, size, world) for n in buckets)
        exact = ring_all_reduce_bytes(plan.total_numel, size, world)
        calls = 0 if world == 1 else len(buckets)
        return StepBytes(compressed, exact, calls, 0 if world == 1 else 1)

    def state_dict(self) -> dict[str, Any]:
        """Step, Q factors and error buffers per parameter name (plus the config), for exact resume."""
        plan = self.plan
        return {
            "step": self.step,
            "config": self.config.as_dict(),
            "q": {e.name: self._q_view(e).clone() for e in plan.compressed},
            "error": {e.name: self._error_view(e).clone() for e in plan.compressed},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the config's rank and thresholds and the parameters must match."""
        for key in ("step", "config", "q", "error"):
            if key not in state:
                raise ValueError(f"PowerSGD state_dict lacks {key!r}: pass the dict made by PowerSGDCompressor.state_dict()")
        saved = state["config"]
        for key in ("rank", "min_compression_rate", "min_numel"):
            if saved.get(key) != getattr(self.config, key):
                raise ValueError(
                    f"PowerSGD state was saved with {key}={saved.get(key)!r} but this compressor has "
                    f"{key}={getattr(self.config, key)!r}: use the same PowerSGDConfig to resume"
                )
        comp = self.plan.compressed
        names = {e.name for e in comp}
        for key in ("q", "error"):
            if set(state[key]) != names:
                missing, extra = sorted(names - set(state[key])), sorted(set(state[key]) - names)
                raise ValueError(
                    f"PowerSGD state_dict[{key!r}] does not match the parameters: missing {missing}, unexpected {extra}"
                )
        for e in comp:
            for key, view in (("q", self._q_view(e)), ("error", self._error_view(e))):
                t = state[key][e.name]
                if tuple(t.shape) != tuple(view.shape):
                    raise ValueError(
                        f"PowerSGD state_dict[{key!r}][{e.name!r}] has shape {tuple(t.shape)}, expected {tuple(view.shape)}"
                    )
                view.copy_(t)
        self.step = int(state["step"])

    def error_buffers(self) -> dict[str, Tensor]:
        """This rank's error-feedback buffer ``(rows, cols)`` per compressed parameter (views)."""
        return {e.name: self._error_view(e) for e in self.plan.compressed}

    # ---------------------------------------------------------------- internals
    def _q_view(self, e: MatrixEntry) -> Tensor:
        """``Q^T`` of entry ``e``: ``(rank, cols)``."""
        return self._q[e.q_offset : e.q_offset + e.cols * e.rank].view(e.rank, e.cols)

    def _error_view(self, e: MatrixEntry) -> Tensor:
        return self._error[e.e_offset : e.e_offset + e.numel].view(e.rows, e.cols)

    def _fresh_q(self, step: int) -> Tensor:
        """Random ``(q_numel,)`` standard normals, identical on every rank (seeded by seed and step)."""
        gen = torch.Generator(device=self._q.device)
        gen.manual_seed(self.config.seed * 1_000_003 + step)
        return torch.randn(self.plan.q_numel, generator=gen, device=self._q.device, dtype=self._q.dtype)

    def _prepare_q(self, step: int) -> None:
        """Warm start: keep Q but redraw columns that vanished (first use, or a zero gradient);
        cold start: a fresh random Q."""
        fresh = self._fresh_q(step)
        if not self.config.warm_start:
            self._q.copy_(fresh)
            return
        eps = self.config.orthogonalisation_eps
        for g in self.plan.q_groups:
            q, new = g.view_t(self._q), g.view_t(fresh)
            dead = q.norm(dim=2, keepdim=True) <= eps  # (k, r, 1)
            q.copy_(torch.where(dead, new, q))

    def _compress(self, grads: Sequence[Tensor], step: int) -> None:
        cfg, plan, world = self.config, self.plan, group_size(self.group)
        comp = plan.compressed
        ref = grads[comp[0].index]
        self._prepare_q(step)
        # M = G + E (E becomes M in place); P = M Q
        matrices: dict[int, Tensor] = {}
        p_flat = ref.new_empty(plan.p_numel)
        for e in comp:
            g = grads[e.index].reshape(e.rows, e.cols)
            if cfg.use_error_feedback:
                m = self._error_view(e)
                m.add_(g)
            else:
                m = g
            matrices[e.index] = m
            p = p_flat[e.p_offset : e.p_offset + e.rows * e.rank].view(e.rows, e.rank)
            torch.matmul(m, self._q_view(e).t(), out=p)
        all_reduce_(p_flat, self.group)
        if world > 1:
            p_flat.div_(world)
        for g in plan.p_groups:
            _orthonormalise_(g.view(p_flat), cfg.orthogonalisation_eps)
        # Q^T = P^T M (the warm start for the next step)
        for e in comp:
            p = p_flat[e.p_offset : e.p_offset + e.rows * e.rank].view(e.rows, e.rank)
            torch.matmul(p.t(), matrices[e.index], out=self._q_view(e))
        all_reduce_(self._q, self.group)
        if world > 1:
            self._q.div_(world)
        # G <- P Q^T ; E <- M - P Q^T
        for e in comp:
            p = p_flat[e.p_offset : e.p_offset + e.rows * e.rank].view(e.rows, e.rank)
            g = grads[e.index]
            if g.is_contiguous():
                torch.matmul(p, self._q_view(e), out=g.view(e.rows, e.cols))
            else:
                g.copy_((p @ self._q_view(e)).view_as(g))
            if cfg.use_error_feedback:
                matrices[e.index].sub_(g.view(e.rows, e.cols) if g.is_contiguous() else g.reshape(e.rows, e.cols))


# --------------------------------------------------------------------------------------------
# torch DDP communication hook
# --------------------------------------------------------------------------------------------


class PowerSGDHookState:
    """State of :func:`powersgd_ddp_hook`: the compressor over the DDP module's parameters and the
    buckets seen so far in this backward pass.

    DDP hands gradients bucket by bucket. Instead of compressing each bucket on its own (3 calls
    per bucket), the hook parks each bucket's future until DDP hands the last bucket, then reduces
    the whole model with the compressor's 3 batched all-reduces and completes every future.
    State is kept per parameter, so DDP's bucket rebuild after the first step changes nothing.

    With a ``model_group`` (model sharding), the gradients of the replicated parameters (no
    :class:`~stormshard.parallel.partition.Partition`) are first summed over that group in one flat
    all-reduce (:func:`~stormshard.parallel.grads.all_reduce_flat_`): the sum must precede the
    compressor, which is not linear.
    """

    def __init__(self, compressor: PowerSGDCompressor, model_group: ProcessGroup | None = None) -> None:
        self.compressor = compressor
        self.model_group = model_group
        self._index = {id(p): i for i, (_, p) in enumerate(compressor.named_params)}
        self._replicated = [i for i, (_, p) in enumerate(compressor.named_params) if get_partition(p) is None]
        self._pending: list[tuple[dist.GradBucket, torch.futures.Future]] = []
        self._grads: dict[int, Tensor] = {}
        self.buckets_last_step = 0  # how many DDP buckets the last reduction gathered

    def add(self, bucket: dist.GradBucket) -> torch.futures.Future:
        buffer = bucket.buffer()
        fut: torch.futures.Future = (
            torch.futures.Future(devices=[buffer.device]) if buffer.device.type == "cuda" else torch.futures.Future()
        )
        offset = 0
        for p in bucket.parameters():
            if id(p) not in self._index:
                raise ValueError(
                    "DDP handed a parameter the compressor does not know: build the compressor over "
                    "ddp_model.parameters() (see register_powersgd_hook)"
                )
            # the bucket buffer holds the parameters' gradients back to back, in bucket order
            self._grads[self._index[id(p)]] = buffer[offset : offset + p.numel()].view(p.shape)
            offset += p.numel()
        self._pending.append((bucket, fut))
        if bucket.is_last():
            self._flush()
        return fut

    def _flush(self) -> None:
        pending, grads = self._pending, self._grads
        self._pending, self._grads = [], {}
        self.buckets_last_step = len(pending)
        n = len(self.compressor.plan.entries)
        if len(grads) != n:
            missing = [self.compressor.plan.entries[i].name for i in range(n) if i not in grads]
            raise ValueError(f"the last DDP bucket arrived before the gradients of {missing[:5]} (of {len(missing)})")
        if group_size(self.model_group) > 1:
            all_reduce_flat_([grads[i] for i in self._replicated], self.model_group)
        self.compressor.reduce_tensors([grads[i] for i in range(n)])
        for bucket, fut in pending:
            fut.set_result(bucket.buffer())


def powersgd_ddp_hook(state: PowerSGDHookState, bucket: dist.GradBucket) -> torch.futures.Future:
    """DDP communication hook: returns a future of the bucket's mean gradients (see PowerSGDHookState)."""
    return state.add(bucket)


# DDP inspects the hook's annotations as objects, not the strings `from __future__` leaves behind
powersgd_ddp_hook.__annotations__ = {
    "state": PowerSGDHookState, "bucket": dist.GradBucket, "return": torch.futures.Future[torch.Tensor]
}


def register_powersgd_hook(
    ddp_model: nn.parallel.DistributedDataParallel,
    config: PowerSGDConfig | None = None,
    group: ProcessGroup | None = None,
    model_group: ProcessGroup | None = None,
) -> PowerSGDHookState:
    """Register :func:`powersgd_ddp_hook` on ``ddp_model`` with a compressor over its parameters.

    ``group`` defaults to the DDP model's process group. With ``model_group`` the hook first sums the
    replicated parameters' gradients over it (see :class:`PowerSGDHookState`). Returns the state (its
    ``compressor`` holds ``state_dict()`` for checkpoints).
    """
    if not isinstance(ddp_model, nn.parallel.DistributedDataParallel):
        raise TypeError(f"ddp_model must be a DistributedDataParallel, got {type(ddp_model).__name__}")
    group = ddp_model.process_group if group is None else group
    compressor = PowerSGDCompressor(ddp_model.module.named_parameters(), group, config)
    state = PowerSGDHookState(compressor, model_group)
    ddp_model.register_comm_hook(state, powersgd_ddp_hook)
    return state
