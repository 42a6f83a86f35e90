"""A census of the operators one steady-state training step runs: dtype casts, copies, sorts, host syncs.

``python benchmarks/step_census.py [--model graphtransformer|transformer] [--precision bf16|fp32]
[--graph-kernel auto|csr|triton] [--device cpu|cuda]`` builds a small model (O16 data -> O8 hidden by
default), runs two warm-up steps (forward, MSE loss, backward, AdamW) and records the third under a
``TorchDispatchMode``: every aten operator with its count, and for each cast (``_to_copy`` / ``copy_``
that changes dtype), each sort and each host sync (``_local_scalar_dense``, ``nonzero``, a copy to the
CPU from another device) the stormshard source line that asked for it. Casts are split into
*parameter* casts (autocast's fp32 -> bf16 copy of a weight, and the bf16 -> fp32 gradient for the
fp32 master weight: inherent to fp32 master weights) and *activation* casts (everything else: the
round trips issue 31 removes). It prints the table and exits; the structural part of a step, so it
runs the same on a CPU as on a GPU (autocast's op lists differ: CUDA autocast runs ``layer_norm``,
``softmax`` and ``sum`` in fp32, which stormshard's layers avoid by calling them explicitly in the
compute dtype).

``census(step)`` is importable: ``tests/test_step_census.py`` holds the counts to account.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # benchmarks/: memory_simulation, bench_gpu_vs_anemoi

COPIES = {"clone", "copy_", "_to_copy", "cat", "stack", "contiguous"}  # a copy when it keeps the dtype
SORTS = {"sort", "argsort", "topk", "unique", "_unique2", "unique_consecutive", "msort"}
SYNCS = {"_local_scalar_dense", "nonzero", "item", "equal", "is_nonzero", "masked_select"}
_PACKAGE = os.sep + "stormshard" + os.sep


@dataclass
class Census:
    """What one step ran: ``ops`` per aten overload packet, and the source lines of the events."""

    ops: Counter = field(default_factory=Counter)
    parameter_casts: Counter = field(default_factory=Counter)
    activation_casts: Counter = field(default_factory=Counter)
    sorts: Counter = field(default_factory=Counter)
    syncs: Counter = field(default_factory=Counter)
    copy_bytes: Counter = field(default_factory=Counter)  # "line (op)" -> bytes written by same-dtype copies

    def table(self) -> str:
        lines = [f"operators: {sum(self.ops.values())} calls of {len(self.ops)} kinds",
                 f"parameter casts (fp32 master weights): {sum(self.parameter_casts.values())}",
                 f"activation casts: {sum(self.activation_casts.values())}"]
        lines += [f"  {n:4d}  {where}" for where, n in self.activation_casts.most_common()]
        lines.append(f"copies (same dtype: clone, contiguous, cat, stack, copy_): "
                     f"{sum(self.copy_bytes.values()) / 2**20:.2f} MiB written")
        lines += [f"  {n / 2**20:9.2f} MiB  {where}" for where, n in self.copy_bytes.most_common(12)]
        lines.append(f"sorts: {sum(self.sorts.values())}")
        lines += [f"  {n:4d}  {where}" for where, n in self.sorts.most_common()]
        lines.append(f"host syncs: {sum(self.syncs.values())}")
        lines += [f"  {n:4d}  {where}" for where, n in self.syncs.most_common()]
        lines.append("most called operators: " + ", ".join(f"{k} {v}" for k, v in self.ops.most_common(12)))
        return "\n".join(lines)


def _caller() -> str:
    """The innermost stormshard source line on the stack (``file:line function``), else the innermost
    frame outside torch (a test's or benchmark's line), else ``torch``."""
    frames = traceback.extract_stack()[:-3]
    for frame in reversed(frames):
        if _PACKAGE in frame.filename:
            path = frame.filename[frame.filename.rindex(_PACKAGE) + 1:]
            return f"{path}:{frame.lineno} {frame.name}"
    for frame in reversed(frames):
        if f"{os.sep}torch{os.sep}optim{os.sep}" in frame.filename:
            return f"torch.optim ({os.path.basename(frame.filename)} {frame.name})"
    for frame in reversed(frames):
        if f"{os.sep}torch{os.sep}" not in frame.filename and frame.name not in ("census", "__torch_dispatch__",
                                                                                 "_caller"):
            return f"{os.path.basename(frame.filename)}:{frame.lineno} {frame.name}"
    return "torch (autograd engine: a backward)"


class _Recorder(TorchDispatchMode):
    def __init__(self, census: Census, parameters: list[torch.Tensor]) -> None:
        super().__init__()
        self.census = census
        self.storages = {p.untyped_storage()._cdata for p in parameters}  # fake tensors have no data pointer
        self.shapes = {tuple(p.shape) for p in parameters}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.census.ops[name] += 1
        out = func(*args, **kwargs)
        cast = False
        if name in ("_to_copy", "copy_", "to"):
            src = args[1] if name == "copy_" else args[0]
            dst = out
            if isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor):
                if src.dtype != dst.dtype:
                    cast = True
                    where = _caller()
                    # a weight's cast (forward) or its gradient's (backward): a parameter's storage or shape
                    is_param = src.untyped_storage()._cdata in self.storages \
                        or dst.untyped_storage()._cdata in self.storages or tuple(src.shape) in self.shapes
                    (self.census.parameter_casts if is_param else self.census.activation_casts)[where] += 1
                if src.device != dst.device and dst.device.type == "cpu":
                    self.census.syncs[_caller() + " (copy to cpu)"] += 1
        if name in COPIES and not cast:
            written = args[0] if name == "copy_" else out
            if isinstance(written, torch.Tensor):
                self.census.copy_bytes[f"{_caller()} ({name})"] += written.numel() * written.element_size()
        if name in SORTS:
            self.census.sorts[_caller()] += 1
        elif name in SYNCS:
            self.census.syncs[f"{_caller()} ({name})"] += 1
        return out


def census(step: Callable[[], object], parameters: list[torch.Tensor]) -> Census:
    """Run ``step`` once under the recorder; a cast of one of ``parameters`` (or of a tensor of a parameter's
    shape: its gradient) counts as a parameter cast."""
    result = Census()
    with _Recorder(result, parameters):
        step()
    return result


def cuda_path_census(size: str = "tiny") -> Census:
    """The census of ``bench_gpu_vs_anemoi``'s model at ``size`` (``tiny``, ``o96``, ``aifs``, ...) on the kernels a
    CUDA step runs (the Triton graph kernel, flex attention), with fake tensors: no data, any size, on a CPU
    (``memory_simulation.stormshard_step``; flex stands in by its memory contract, its outputs and gradients
    in their inputs' memory order as flex makes them). One step makes AdamW's state, the next is counted."""
    import memory_simulation as sim

    step, parameters, mode, _label = sim.stormshard_step(size)
    with sim.cuda_kernels_on_fake_tensors(), mode, sim.AllocationRecorder(mode):
        step()
        return census(step, parameters)


def cuda_path_size(size: str) -> dict[str, int]:
    """``cuda_path_census``'s model at ``size``: its data and hidden node counts, channels and layers."""
    import bench_gpu_vs_anemoi as bench

    spec = bench.SIZES[size]
    graph, _path = bench.size_graph(spec)
    return {"data_nodes": graph["data"].num_nodes, "hidden_nodes": graph["hidden"].num_nodes,
            "channels": spec.channels, "layers": spec.layers}


def small_model_step(model_name: str = "graphtransformer", precision: str = "bf16", graph_kernel: str = "auto",
                     device: str = "cpu", grid: str = "o16", hidden: str = "o8",
                     channels: int = 32) -> tuple[Callable[[], float], list[torch.Tensor]]:
    """``(step, parameters)`` of a small model: forward under autocast (bf16) or fp32, MSE loss in fp32,
    backward, AdamW; the parameters' gradients are kept between steps (``zero_grad(set_to_none=False)``,
    so the census sees the gradient buffers)."""
    from stormshard.graphs.builder import GraphConfig, KNNEdges, build_graph
    from stormshard.models.config import ModelConfig
    from stormshard.models.registry import build_model
    from stormshard.models.variables import VariableIndex

    dev = torch.device(device)
    names = [f"var_{i}" for i in range(6)]
    variables = VariableIndex.build(names, forcing=names[-1:], diagnostic=[])
    graph = build_graph(GraphConfig(data_grid=grid, hidden=hidden, processor=KNNEdges(num_neighbours=4)))
    config = ModelConfig(name=model_name, num_channels=channels, multistep_input=2, trainable_size=4,
                         processor=dict(num_layers=2, num_heads=4, window_size=16, mlp_ratio=2),
                         encoder=dict(num_heads=4, num_chunks=2), decoder=dict(num_heads=4, num_chunks=2),
                         graph_kernel=graph_kernel)
    torch.manual_seed(0)
    model = build_model(config, graph, variables).to(dev)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    cells = graph["data"].num_nodes
    x = torch.randn(1, 2, cells, len(variables.input_names), generator=gen).to(dev)
    target = torch.randn(1, cells, len(variables.output_names), generator=gen).to(dev)

    def step() -> float:
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            pred = model(x)
        loss = (pred.float() - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        return float(loss.detach())

    return step, list(model.parameters())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="graphtransformer", choices=["graphtransformer", "transformer", "gnn"])
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--graph-kernel", default="auto", choices=["auto", "csr", "triton"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--grid", default="o16")
    parser.add_argument("--hidden", default="o8")
    parser.add_argument("--quick", action="store_true", help="(the default sizes are already small)")
    parser.add_argument("--cuda-path", metavar="SIZE", default=None,
                        help="instead: bench_gpu_vs_anemoi's model at SIZE (tiny, o96, aifs) on the CUDA step's kernels, "
                             "fake tensors on the CPU (cuda_path_census)")
    args = parser.parse_args(argv)
    if args.cuda_path:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton graph kernel allowed on a CPU (never launched)
        print(f"one steady-state step on the CUDA path, fake tensors: bench_gpu_vs_anemoi's {args.cuda_path}, bf16")
        print(cuda_path_census(args.cuda_path).table())
        return 0
    step, params = small_model_step(args.model, args.precision, args.graph_kernel, args.device, args.grid,
                                    args.hidden)
    for _ in range(2):
        step()
    result = census(step, params)
    print(f"one steady-state step: model {args.model}, {args.precision}, graph kernel {args.graph_kernel}, "
          f"{args.device}, {args.grid} -> {args.hidden}")
    print(result.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
