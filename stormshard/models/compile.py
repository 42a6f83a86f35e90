"""``training.compile``: torch.compile applied per block, in place, after the parallelize step.

The order is torchtitan's (``parallelize_llama``): tensor parallelism, activation checkpointing,
compile, then the engine (DeepSpeed, DDP) wraps the model. :func:`compile_blocks` compiles, each
on its own, every block of every ``blocks`` ``nn.ModuleList`` of the model (the processor's
transformer, graph-transformer, GNN or conditional blocks, wrapped in
:class:`~stormshard.layers.checkpointing.ActivationCheckpoint` or not) and the model's ``encoder``
and ``decoder`` mappers. Per block, not the whole model: identical blocks share one compiled
graph, a compile error names one block, and the code between blocks (embeddings, the residual
update, the loss) stays eager.

Each block is compiled with :meth:`torch.nn.Module.compile`, in place: the module tree, parameter
names and ``state_dict`` keys do not change (no ``_orig_mod.`` prefix), so checkpoints move
between compiled and eager runs both ways. ``fullgraph=True``: the blocks compile without a
graph break (the kernels that are python loops or sparse products are torch custom ops, opaque
to dynamo: the banded window kernel, the fused graph attention; the collectives of a sharded
block trace as torch's functional collectives; the eager-only fused GNN kernels give way to their plain
autograd path, which inductor fuses). Shapes are static (``dynamic=False``): a block sees the same
shapes every step, so it compiles once for training and once for validation (``no_grad``).

``cuda_graphs=True`` (``training.cuda_graphs``) marks the tensors the blocks hold outside their
parameters and buffers (shard plans' edge and halo indices) as static addresses
(:func:`mark_static_tensors`) and compiles the blocks with ``mode="reduce-overhead"``:
inductor records each compiled block's forward and backward as CUDA graphs (torch's CUDA graph trees)
and replays them, one launch per graph instead of one per kernel, for steps whose shapes are static
(they are: the grids, graphs and batch do not change). The caller marks each step's start with
:func:`begin_graphed_step` (training and every validation batch), which frees the previous step's
graph outputs; a block inductor cannot graph (an op on the CPU, an unsupported operator) runs
compiled without a graph and is counted in ``torch._dynamo.utils.counters["inductor"]
["cudagraph_skips"]`` (:func:`cuda_graph_skips`). On a CPU inductor records no graph (it counts a skip).

Nothing is communicated here; the compiled blocks communicate what the eager ones do.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from stormshard.env import env_choice
from stormshard.kernels.dispatch import prepare_attention_kernels
from stormshard.layers.checkpointing import unwrapped_modules
from stormshard.parallel.graph import GraphShardPlan

__all__ = ["compile_blocks", "compiled_block_names", "compile_backend", "wants_compile", "COMPILED_TARGETS",
           "BACKEND_VARIABLE", "CUDA_GRAPH_MODE", "begin_graphed_step", "cuda_graph_skips", "cuda_graphs_problem",
           "mark_static_tensors", "HALO_TRACE_TORCH", "traces_halo_exchange"]

#: the environment variable that picks torch.compile's backend (default ``"inductor"``; ``"aot_eager"``
#: traces and runs the same graphs without code generation: for debugging and quick tests)
BACKEND_VARIABLE = "STORMSHARD_COMPILE_BACKEND"

#: the module attributes compiled besides the blocks of every ``blocks`` ModuleList
COMPILED_TARGETS = ("encoder", "decoder")

#: torch.compile's mode for ``cuda_graphs=True``: inductor with CUDA graph trees
CUDA_GRAPH_MODE = "reduce-overhead"

#: the oldest torch whose dynamo traces a sharded graph block's halo exchange right: under torch 2.11 a compiled
#: graph block with halos (GNN or graph transformer, ``parallel.gpus_per_model`` > 1) took gradients 1e-5 - 1e-4
#: (relative) off the eager block's, where torch 2.13 gives the eager numbers
HALO_TRACE_TORCH = "2.13"

# recompiles a compiled block may take (per code object) beyond one per block kind: training and
# validation (grad mode), a few shapes (e.g. a validation batch of another size)
_RECOMPILES_PER_BLOCK = 4


def _targets(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of every block to compile, in module order, each once."""
    found: dict[int, tuple[str, nn.Module]] = {}  # by identity: a module shared by two parents once
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.ModuleList) and leaf == "blocks":
            for i, block in enumerate(module):
                found.setdefault(id(block), (f"{name}.{i}", block))
        elif leaf in COMPILED_TARGETS and "." not in name:
            found.setdefault(id(module), (name, module))
    return list(found.values())


def compile_backend(env: Mapping[str, str] | None = None) -> str:
    """torch.compile's backend: ``STORMSHARD_COMPILE_BACKEND`` (default ``"inductor"``), one of the backends
    torch registers (``torch._dynamo.list_backends``); another name is an :class:`~stormshard.env.EnvError`
    naming the variable and the choices (the training preflight asks, before any work)."""
    from torch._dynamo import list_backends

    return env_choice(BACKEND_VARIABLE, "inductor", list_backends(exclude_tags=()), env)


def compiled_block_names(model: nn.Module) -> list[str]:
    """The names of the modules of ``model`` that :func:`compile_blocks` compiled (in place)."""
    return [name for name, module in model.named_modules() if getattr(module, "_compiled_call_impl", None) is not None]


def compile_blocks(model: nn.Module, *, backend: str | None = None, fullgraph: bool = True, dynamic: bool = False,
                   options: dict[str, Any] | None = None, cuda_graphs: bool = False) -> list[str]:
    """Compile every processor block and the encoder and decoder of ``model`` in place; their names.

    ``model``: built and parallelized (tensor-parallel blocks swapped in, activation checkpointing
    wrapped), not yet wrapped by an engine. ``backend``: torch.compile's backend (None: the
    ``STORMSHARD_COMPILE_BACKEND`` environment variable, else ``"inductor"``). Compiles every block of every ``nn.ModuleList``
    named ``blocks`` and the top-level ``encoder`` / ``decoder`` with
    ``module.compile(backend=backend, fullgraph=fullgraph, dynamic=dynamic, options=options)``;
    a module already compiled is left as it is (a second call changes nothing). ``cuda_graphs``: compile
    with ``mode="reduce-overhead"`` (inductor's CUDA graph trees; not with ``options``, and only with the
    ``inductor`` backend: a ValueError otherwise); mark each step with :func:`begin_graphed_step`. Raises
    ValueError, naming ``training.compile``, when the model has none of these (a custom builder's
    model without ``processor.blocks``, ``encoder`` or ``decoder``). Raises dynamo's error at a
    block's first call if it cannot compile without a graph break (``fullgraph=True``).

    Raises dynamo's per-code-object recompile limit to fit every block kind's training and
    validation graphs (``torch._dynamo.config.cache_size_limit``; never lowered).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    targets = _targets(model)
    if not targets:
        raise ValueError(
            f"training.compile is true but the model ({type(model).__name__}) has no blocks to compile: "
            "stormshard compiles every block of an nn.ModuleList named 'blocks' (processor.blocks) and the "
            "top-level 'encoder' and 'decoder'; give the model such modules, or set training.compile false"
        )
    backend = backend or compile_backend()
    if cuda_graphs and backend != "inductor":
        raise ValueError(f"training.cuda_graphs needs torch.compile's inductor backend, not {backend!r}: unset "
                         f"{BACKEND_VARIABLE} or set training.cuda_graphs false")
    if cuda_graphs and options:
        raise ValueError("compile_blocks: cuda_graphs=True sets torch.compile's mode, which cannot be combined with "
                         "options: pass {'triton.cudagraphs': True} in options instead")
    import torch._dynamo

    prepare_attention_kernels()  # probe flash-attn / flex once, eagerly: compiled blocks only read the answers
    limit = _RECOMPILES_PER_BLOCK * len(targets)
    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, limit)
    config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 2 * limit)
    names = []
    for name, module in targets:
        if not traces_halo_exchange(module):
            warnings.warn(f"training.compile: {name} exchanges graph halos, which torch {torch.__version__} does not "
                          f"trace right (wrong gradients): it runs eagerly; torch {HALO_TRACE_TORCH} or newer compiles "
                          "it", stacklevel=2)
            continue
        if cuda_graphs:
            mark_static_tensors(module)
        if getattr(module, "_compiled_call_impl", None) is None:
            module.compile(backend=backend, fullgraph=fullgraph, dynamic=dynamic, options=options,
                           mode=CUDA_GRAPH_MODE if cuda_graphs else None)
        names.append(name)
    return names


def traces_halo_exchange(module: nn.Module, version: str | None = None) -> bool:
    """Whether torch (``version``; None: the one installed) compiles ``module`` right: False when ``module`` holds a
    graph block whose shard plan exchanges halos (``gpus_per_model`` > 1) and torch is older than
    :data:`HALO_TRACE_TORCH`; :func:`compile_blocks` leaves such a block eager."""
    from torch.torch_version import TorchVersion

    if TorchVersion(version or torch.__version__) >= HALO_TRACE_TORCH:
        return True
    return not any(isinstance(plan := getattr(m, "plan", None), GraphShardPlan) and sum(plan.halo_per_rank) > 0
                   for m in unwrapped_modules(module))


def wants_compile(setting: bool | str, device_type: str) -> bool:
    """Whether ``training.compile`` (``True``, ``False`` or ``"auto"``) compiles the blocks on ``device_type``:
    ``"auto"`` compiles on CUDA (measured on an H100: the O96 -> O48 model's bf16 step 1.62x, the AIFS-shape
    processor 1.34x faster) and not elsewhere (on a CPU the first step's compile costs 6-35 s for a
    1.1-1.9x faster step of a small model)."""
    if setting == "auto":
        return device_type == "cuda"
    return bool(setting)


def _held_tensors(value: Any, depth: int = 0) -> Iterator[Tensor]:
    """The tensors in ``value``: itself, or inside a dataclass, tuple, list or dict (a few levels deep)."""
    if isinstance(value, Tensor):
        yield value
    elif depth < 4 and dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _held_tensors(getattr(value, f.name, None), depth + 1)
    elif depth < 4 and isinstance(value, (tuple, list)):
        for item in value:
            yield from _held_tensors(item, depth + 1)
    elif depth < 4 and isinstance(value, dict):
        for item in value.values():
            yield from _held_tensors(item, depth + 1)


def mark_static_tensors(module: nn.Module) -> int:
    """Mark every tensor the modules of ``module`` hold besides their parameters and buffers (a shard plan's
    edge index and halo indices, the edge chunks' ids and indices: attributes set once at construction and
    moved with the module) as a static address for CUDA graphs (``torch._dynamo.mark_static_address``).
    A graph then reads them where they are: without the mark each replay would copy them into the graph's
    own input buffers, and a kernel whose sorted structure is cached per edge-index tensor
    (:mod:`~stormshard.kernels.graph_triton`) would see a new tensor, rebuild it and wait for the device
    inside a capture. Returns how many tensors were marked."""
    from torch._dynamo import mark_static_address

    seen: set[int] = set()
    for sub in unwrapped_modules(module):  # a checkpointed block's own attributes too (its plan)
        owned = {id(t) for t in (*sub.parameters(recurse=False), *sub.buffers(recurse=False))}
        for key, value in vars(sub).items():
            if key in ("_parameters", "_buffers", "_modules") or key.startswith("__"):
                continue
            for tensor in _held_tensors(value):
                if id(tensor) in owned or id(tensor) in seen or isinstance(tensor, nn.Parameter):
                    continue
                seen.add(id(tensor))
                mark_static_address(tensor)
    return len(seen)


def cuda_graphs_problem(device_type: str, compiles: bool, backend: str) -> str | None:
    """Why ``training.cuda_graphs`` cannot run here (one sentence naming the fix), or None: it needs a
    CUDA device, compiled blocks (``training.compile`` true, or ``"auto"`` on CUDA) and the inductor backend."""
    if device_type != "cuda":
        return (f"training.cuda_graphs = true: CUDA graphs need a CUDA device and this run is on {device_type!r}: "
                "set training.cuda_graphs false")
    if not compiles:
        return ("training.cuda_graphs = true: CUDA graphs are recorded by the compiled blocks and training.compile "
                "is false: set training.compile true (or \"auto\") or training.cuda_graphs false")
    if backend != "inductor":
        return (f"training.cuda_graphs = true: CUDA graphs need torch.compile's inductor backend, and "
                f"{BACKEND_VARIABLE} = {backend!r}: unset it or set training.cuda_graphs false")
    return None


def begin_graphed_step() -> None:
    """Mark the start of a training step or validation batch for blocks compiled with ``cuda_graphs``:
    the graphs' outputs of the previous step may be overwritten from here on (torch's
    ``cudagraph_mark_step_begin``; once called, steps begin only where it is called). Host-only: a counter."""
    torch.compiler.cudagraph_mark_step_begin()


def cuda_graph_skips() -> int:
    """How many compiled graphs inductor could not record as CUDA graphs in this process (each such block
    runs compiled without a graph; inductor's log says why: ``TORCH_LOGS=cudagraphs``)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])
