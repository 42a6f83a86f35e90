"""What one eager training step holds in device memory at its peak, simulated on a CPU with fake tensors.

The machinery behind ``benchmarks/bench_memory.py`` (and ``anemoi_side/memory_vs_stormshard.py``).
``benchmarks/memory_census.py`` answers the question on a GPU (the CUDA allocator's history); this answers it
without one, at any size, in seconds: a model (here :func:`stormshard_step`: the one of ``bench_gpu_vs_anemoi.py``'s
size, the same config, graph and optimizer) with every parameter, input and activation a ``FakeTensor`` (shapes,
dtypes and storages, no data), one step run twice (the first makes AdamW's state) and the second recorded by
:class:`AllocationRecorder`: every storage an operator makes, with the source line that asked for it, and the
moment that storage dies (its last reference gone: autograd's saved tensors included). Operators on real tensors
alone (graph structures, buffers) and new integer tensors (indices) run for real, as they would on the GPU, since
a model may read their values. The events go through ``memory_census.live_at_peak``, the same analysis as the GPU
census, so the two tables read the same.

The kernels are the ones a CUDA step runs (:func:`cuda_kernels_on_fake_tensors`): the Triton graph kernel's own
Python (its outputs, saved tensors and fp32 work buffers, exactly) with its launches skipped, and flex attention's
memory contract (it keeps q, k, v, the output and the fp32 log-sum-exp; its backward makes dq, dk, dv and an fp32
row term) in place of the compiled flex call. Autocast is the CPU's (bf16), whose op lists match CUDA's for what
this model runs (linear and matmul in bf16; stormshard calls layer norms in the compute dtype itself).

What it does not see: the caching allocator's rounding and fragmentation (``max_memory_allocated`` counts whole
512-byte blocks; the difference is small for large tensors), a kernel's scratch space inside one launch, the CUDA
context and library workspaces (cuBLAS: tens of MiB), and compiled blocks (``training.compile``): inductor decides
what a compiled block saves (stormshard's custom ops keep what they keep, compiled or not; around them inductor
may save less or more than eager), so these are eager steps.

``simulate_step_memory(step, ...)`` is importable; ``tests/test_memory_simulation.py`` checks it against the
tensors a real CPU step keeps.
"""
from __future__ import annotations

import contextlib
import os
import sys
import traceback
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "anemoi_side"))

from memory_census import PeakCensus, live_at_peak  # noqa: E402

__all__ = ["AllocationRecorder", "SimulatedStep", "simulate_step_memory", "fake_parameters",
           "cuda_kernels_on_fake_tensors", "stormshard_step", "largest_at_peak", "attention_memory"]

GIB = 1024 ** 3


_RECORDER_FRAMES = {"__torch_dispatch__", "_record_outputs", "record", "_frames"}


def _frames() -> list[dict[str, object]]:
    """The Python stack, innermost first, in the allocator trace's frame format (the recorder's own left out)."""
    stack = [f for f in traceback.extract_stack() if not (f.filename == __file__ and f.name in _RECORDER_FRAMES)]
    return [{"filename": f.filename, "line": f.lineno, "name": f.name} for f in reversed(stack)]


class AllocationRecorder(TorchDispatchMode):
    """Records, in the CUDA allocator trace's format (``alloc`` / ``free_completed`` with ``addr``, ``size`` and
    ``frames``), every new storage an operator returns and the moment it dies. A result that shares an input's
    storage (a view, an in-place result) is not an allocation; a storage is identified by its C++ object while
    it lives."""

    def __init__(self, fake_mode=None) -> None:  # noqa: ANN001 - a FakeTensorMode
        super().__init__()
        self.fake_mode = fake_mode
        self.events: list[dict[str, object]] = []
        self.live: dict[int, int] = {}  # storage id -> bytes

    def _as_fake(self, t: object) -> object:
        """A real tensor under the fake mode as the mode sees it (its memoized fake copy), so that a view of a
        real constant (a graph buffer) shares that copy's storage, as a view of the constant does for real."""
        if (isinstance(t, torch.Tensor) and not isinstance(t, self._fake_type) and t.layout == torch.strided
                and t.dim() > 0):  # scalars stay real: the fake mode reads their values (an optimizer's step)
            return self.fake_mode.from_tensor(t)
        return t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if self.fake_mode is not None and torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None:
            if (tensors and not any(isinstance(t, self._fake_type) for t in tensors)) or (
                    not tensors and self._makes_indices(func, args, kwargs)):
                # real tensors only (graph structures, buffers), or a new integer tensor (an index: a degree count,
                # a CSR pointer): computed for real, as on a GPU (a model may read their values)
                from torch._subclasses.fake_tensor import unset_fake_temporarily

                with unset_fake_temporarily():
                    out = func(*args, **kwargs)
                self._record_outputs(func, tensors, out)
                return out
            # a real constant meeting a fake tensor: converted here as the fake mode would, so that a view of
            # it shares its fake copy's storage
            args, kwargs = pytree.tree_map(self._as_fake, (args, kwargs))
            tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        out = func(*args, **kwargs)
        self._record_outputs(func, tensors, out)
        return out

    @staticmethod
    def _makes_indices(func, args: tuple, kwargs: dict) -> bool:  # noqa: ANN001
        """Whether an operator without tensor inputs (a factory) makes an integer or bool tensor."""
        try:
            out = func(*args, **kwargs)  # under the fake mode: no memory, no values
        except Exception:  # noqa: BLE001 - then it runs as it would have
            return False
        leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return bool(leaves) and not any(t.dtype.is_floating_point or t.dtype.is_complex for t in leaves)

    def _record_outputs(self, func, inputs: list[torch.Tensor], out: object) -> None:  # noqa: ANN001
        # views and in-place results share an input's storage: not an allocation (a sparse tensor's parts are
        # recorded when they are made)
        storages = {t.untyped_storage()._cdata for t in inputs if t.layout == torch.strided}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.untyped_storage()._cdata not in storages:
                self.record(t, str(func.overloadpacket.__name__))

    @property
    def _fake_type(self) -> type:
        from torch._subclasses.fake_tensor import FakeTensor

        return FakeTensor

    def record(self, t: torch.Tensor, op: str = "") -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.live:
            return
        size = storage.nbytes()
        self.live[key] = size
        self.events.append({"action": "alloc", "addr": key, "size": size, "frames": _frames(),
                            "tensor": f"{op} {tuple(t.shape)} {str(t.dtype).removeprefix('torch.')}"})
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        if self.live.pop(key, None) is not None:
            self.events.append({"action": "free_completed", "addr": key, "size": size, "frames": []})

    def live_bytes(self) -> int:
        return sum(self.live.values())


def largest_at_peak(events: list[dict[str, object]], top: int = 15) -> list[tuple[int, str, str]]:
    """The ``top`` largest allocations alive at the peak of ``events`` (replayed as ``live_at_peak`` does):
    ``(bytes, tensor, source)``, the tensor as ``op (shape) dtype``."""
    from memory_census import source_of

    live: dict[int, dict[str, object]] = {}
    current = peak = 0
    at_peak: list[dict[str, object]] = []
    for event in events:
        if event["action"] == "alloc":
            live[int(event["addr"])] = event
            current += int(event["size"])
            if current > peak:
                peak, at_peak = current, list(live.values())
        else:
            if live.pop(int(event["addr"]), None) is not None:
                current -= int(event["size"])
    at_peak.sort(key=lambda e: -int(e["size"]))
    return [(int(e["size"]), str(e.get("tensor", "")), source_of(e.get("frames", []))) for e in at_peak[:top]]


@dataclass(frozen=True)
class SimulatedStep:
    """The recorded step's :class:`~memory_census.PeakCensus` and what was alive before it: ``parameters``
    (weights), ``state`` (what earlier steps left: AdamW's moments, kept gradients, cached kernel structures)."""

    census: PeakCensus
    parameters: int
    state: int
    largest: list[tuple[int, str, str]]

    def table(self, top: int = 20) -> str:
        lines = [f"simulated eager step (fake tensors): weights {self.parameters / GIB:.2f} GiB, state kept between "
                 f"steps {self.state / GIB:.2f} GiB (optimizer moments, caches)", self.census.table(top),
                 "the largest tensors alive at the peak (the operator that made each; a source outside stormshard "
                 "is autograd's backward):"]
        lines += [f"  {size / GIB:7.3f} GiB  {tensor:48s} {source}" for size, tensor, source in self.largest[:top]]
        return "\n".join(lines)


def simulate_step_memory(step: Callable[[], object], parameters: list[torch.Tensor], warmup: int = 1,
                         fake_mode=None) -> SimulatedStep:  # noqa: ANN001 - a FakeTensorMode
    """Run ``step`` ``warmup`` times and once more, recording every storage (:class:`AllocationRecorder`);
    the census of the last run, its baseline the weights (``parameters``' storages) plus what the warm-up
    runs left alive. ``step`` runs fake tensors (:func:`fake_parameters`, under ``fake_mode``, entered by the
    caller) or real ones (a test's reference)."""
    weights = sum({p.untyped_storage()._cdata: p.untyped_storage().nbytes() for p in parameters}.values())
    recorder = AllocationRecorder(fake_mode)
    with recorder:
        for _ in range(warmup):
            step()
        state = recorder.live_bytes()
        first = len(recorder.events)
        step()
    events = recorder.events[first:]
    return SimulatedStep(live_at_peak(events, weights + state), weights, state, largest_at_peak(events, 30))


def fake_parameters(module: torch.nn.Module, mode) -> list[torch.Tensor]:  # noqa: ANN001 - a FakeTensorMode
    """Replace every parameter of ``module`` by a fake one of its shape, dtype and ``requires_grad`` (buffers
    and the graph structures stay real: the fake mode reads them as constants); returns the new parameters."""
    made: dict[int, torch.nn.Parameter] = {}
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is None:
                continue
            if id(p) not in made:
                made[id(p)] = torch.nn.Parameter(mode.from_tensor(p.detach()), requires_grad=p.requires_grad)
            sub._parameters[name] = made[id(p)]
    return list(made.values())


@torch.library.custom_op("stormshard_sim::attention_output", mutates_args=())
def _attention_output(q: torch.Tensor, lse_shape: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention kernel's outputs, no arithmetic: the output like ``q`` (its memory order) and the fp32
    log-sum-exp. An operator, so that selective checkpointing keeps it as it keeps flex attention's outputs
    (registered in :func:`cuda_kernels_on_fake_tensors`)."""
    return _dense_like(q), q.new_empty(lse_shape, dtype=torch.float32)


_attention_output.register_fake(lambda q, lse_shape: (_dense_like(q), q.new_empty(lse_shape, dtype=torch.float32)))


class _AttentionMemory(torch.autograd.Function):
    """An attention kernel's memory contract, no arithmetic: the output like ``q``; keeps q, k, v, the output, the
    fp32 log-sum-exp of ``lse_shape`` and ``keep`` (a mask, or None); its backward makes dq, dk, dv and one fp32
    work tensor: the dq accumulator (``q``'s shape) or a row term (the log-sum-exp's)."""

    @staticmethod
    def forward(ctx, q, k, v, keep, lse_shape, dq_accumulator):  # noqa: ANN001, ANN205
        out, lse = torch.ops.stormshard_sim.attention_output(q, list(lse_shape))
        ctx.save_for_backward(q, k, v, out, lse, keep)
        ctx.dq_accumulator = dq_accumulator
        return out

    @staticmethod
    def backward(ctx, grad_out):  # noqa: ANN001, ANN205
        q, k, v, _out, lse, _keep = ctx.saved_tensors
        work = torch.empty(q.shape if ctx.dq_accumulator else lse.shape, dtype=torch.float32, device=q.device)
        del work
        return _dense_like(q), _dense_like(k), _dense_like(v), None, None, None


def _dense_like(t: torch.Tensor) -> torch.Tensor:
    """A new dense tensor like ``t`` in ``t``'s memory order (its dimensions by decreasing stride), as flex
    attention makes its output and gradients (``empty_like`` makes a view with gaps contiguous)."""
    order = sorted(range(t.dim()), key=lambda i: (-t.stride(i), i))
    return torch.empty_permuted(t.shape, order, dtype=t.dtype, device=t.device)


def attention_memory(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, lse_shape: tuple[int, ...],
                     keep: torch.Tensor | None = None, dq_accumulator: bool = False) -> torch.Tensor:
    """An attention kernel in memory only (:class:`_AttentionMemory`): flex attention and CUDA's SDPA keep a
    ``(batch, heads, seq)`` log-sum-exp (SDPA its mask too), flash-attn v2 one of ``(batch, heads, seq)`` for
    ``(batch, seq, heads, d)`` inputs and an fp32 dq accumulator in its backward."""
    return _AttentionMemory.apply(q, k, v, keep, tuple(lse_shape), dq_accumulator)


def _flex_memory(q, k, v, block_mask=None, scale=None, kernel_options=None):  # noqa: ANN001, ANN202
    return attention_memory(q, k, v, lse_shape=q.shape[:-1])


class _NoLaunch:
    """A Triton kernel whose launches do nothing: ``kernel[grid](*args)``."""

    def __getitem__(self, grid):  # noqa: ANN001, ANN204
        return lambda *args, **kwargs: None


class _NoLaunchKernels:
    def __getattr__(self, name: str) -> _NoLaunch:
        return _NoLaunch()


@contextlib.contextmanager
def cuda_kernels_on_fake_tensors() -> Iterator[None]:
    """The kernels a CUDA step runs, on fake CPU tensors (module docstring): the Triton graph kernel's Python
    with its launches skipped and its sorted structures built from the real edge indices outside the fake
    mode (cached, as on a GPU); flex attention by its memory contract (:func:`attention_memory`)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from stormshard.kernels import flex, graph_triton
    from stormshard.kernels.attention_ops import register_attention_op

    register_attention_op(_attention_output)  # flex's stand-in: kept by selective checkpointing, as flex is
    build = graph_triton.triton_graph_structure

    def structure(edge_index: torch.Tensor, num_src: int, num_dst: int):  # noqa: ANN202
        with unset_fake_temporarily():
            return build(edge_index, num_src, num_dst)

    saved = (graph_triton._kernels, graph_triton.triton_graph_structure, flex.flex_unusable, flex._flex_attention,
             flex._CPU_SEPARATE_BUFFERS)
    graph_triton._kernels = lambda: _NoLaunchKernels()
    graph_triton.triton_graph_structure = structure
    flex.flex_unusable = lambda *args, **kwargs: None
    flex._flex_attention = lambda: _flex_memory
    flex._CPU_SEPARATE_BUFFERS = False  # CUDA's flex takes q, k, v as views of one buffer under every torch
    try:
        yield
    finally:
        (graph_triton._kernels, graph_triton.triton_graph_structure, flex.flex_unusable, flex._flex_attention,
         flex._CPU_SEPARATE_BUFFERS) = saved


def stormshard_step(size_name: str, precision: str = "bf16", encoder_chunks: int | None = None,
                    decoder_chunks: int | None = None, lean: bool = True, checkpointing: bool | str | None = None,
                    encoder_checkpointing: bool | str = False):
    """``(step, parameters, mode, label)``: ``bench_gpu_vs_anemoi``'s model at ``size_name`` with the kernels a
    CUDA step runs (graph kernel "triton", attention kernel "flex"), its parameters, inputs and AdamW fake.
    ``lean=False``: ``model.lean_activations`` false (every norm before its projection, plain MLPs): the
    baseline of ``bench_memory.py``. ``checkpointing``: ``model.activation_checkpointing`` in place of the
    size's (e.g. ``"selective"``), ``encoder_checkpointing`` ``model.encoder.activation_checkpointing``. Run
    ``step`` inside :func:`cuda_kernels_on_fake_tensors`, under ``mode``."""
    import bench_gpu_vs_anemoi as bench
    from torch._subclasses.fake_tensor import FakeTensorMode

    from stormshard.layers.checkpointing import checkpoint_mode
    from stormshard.models.registry import build_model

    size = bench.SIZES[size_name]
    graph, _path = bench.size_graph(size)
    variables = bench.size_variables(size)
    config = bench.size_config(size)
    updates: dict[str, object] = {"graph_kernel": "triton",
                                  "processor": config.processor.model_copy(update={"attention_kernel": "flex"})}
    for section, chunks in (("encoder", encoder_chunks), ("decoder", decoder_chunks)):
        if chunks is not None:
            updates[section] = getattr(config, section).model_copy(update={"num_chunks": chunks})
    if encoder_checkpointing:
        updates["encoder"] = updates.get("encoder", config.encoder).model_copy(
            update={"activation_checkpointing": encoder_checkpointing})
    if checkpointing is not None:
        updates["activation_checkpointing"] = checkpointing
    config = config.model_copy(update={**updates, "lean_activations": lean})
    torch.manual_seed(0)
    model = build_model(config, graph, variables)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    parameters = fake_parameters(model, mode)
    cells = graph["data"].num_nodes
    with mode:
        x = torch.empty(1, config.multistep_input, cells, len(variables.input_names))
        target = torch.empty(1, cells, len(variables.output_names))
    # what build_adamw makes on CUDA: torch's fused AdamW, its moments made at the first step (on a CPU it makes
    # flat moments at construction)
    optimizer = torch.optim.AdamW(parameters, lr=1e-4, fused=True)
    autocast = precision == "bf16"

    def step() -> None:  # bench_gpu.mse_training_step without its loss readout (no values here)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            pred = model(x)
        loss = (pred.float() - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    extra = ('' if lean else ', memory-lean paths off') + (', selective checkpointing'
                                                            if config.activation_checkpointing == "selective" else '')
    extra += f", encoder checkpointed ({checkpoint_mode(encoder_checkpointing)})" if encoder_checkpointing else ""
    return step, parameters, mode, f"{size.label}, {precision}{extra}"
