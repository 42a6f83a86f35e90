"""A steady-state training step does no per-step host work and no activation dtype round trips.

The census (``benchmarks/step_census.py``) records every aten operator of one step after two warm-up
steps: sorts (a CSR structure rebuilt per call), host syncs, and dtype casts with the stormshard line
that asked for them. Issue 31: the graph kernels' structures are built once per chunk (before: 24
sorts per step of this model, 8 CSR rebuilds), and under bf16 autocast the only activation casts are
the model's input and output (plus, on the csr kernel, its fp32 inputs, by design on a CPU).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

from stormshard.layers.norm import LayerNorm

_PATH = pathlib.Path(__file__).resolve().parents[1] / "benchmarks" / "step_census.py"
_spec = importlib.util.spec_from_file_location("step_census", _PATH)
step_census = importlib.util.module_from_spec(_spec)
sys.modules["step_census"] = step_census  # its dataclass looks its module up
_spec.loader.exec_module(step_census)


def _steady_census(model: str, precision: str, graph_kernel: str = "auto", grid: str = "o8",  # noqa: ANN202
                   hidden: str = "o4", warmup: int = 2):
    step, params = step_census.small_model_step(model, precision, graph_kernel, grid=grid, hidden=hidden, channels=16)
    for _ in range(warmup):
        step()
    return step_census.census(step, params)


def _ours(counter) -> dict[str, int]:  # noqa: ANN001
    return {where: n for where, n in counter.items() if where.startswith("stormshard/")}


@pytest.mark.parametrize("model", ["graphtransformer", "transformer", "gnn"])
def test_a_steady_step_sorts_nothing_and_never_waits_for_the_device(model):
    result = _steady_census(model, "fp32")
    assert not result.sorts, f"sorts in a steady-state step:\n{result.table()}"
    assert not _ours(result.syncs), f"host syncs asked for by stormshard:\n{result.table()}"
    assert not result.activation_casts and not result.parameter_casts, result.table()


def test_bf16_casts_only_at_the_model_boundary_and_in_the_csr_kernel():
    result = _steady_census("graphtransformer", "bf16", "csr")
    ours = _ours(result.activation_casts)
    allowed = ("stormshard/models/encoder_processor_decoder.py", "stormshard/kernels/dispatch.py")
    assert all(where.startswith(allowed) for where in ours), result.table()
    boundary = sum(n for where, n in ours.items() if where.startswith(allowed[0]))
    assert boundary <= 3, result.table()  # the inputs' cast to bf16 (data, hidden features), the output's to fp32


def test_layer_norm_keeps_the_compute_dtype_under_autocast():
    torch.manual_seed(0)
    norm = LayerNorm(24)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    x = torch.randn(7, 3, 24)
    torch.testing.assert_close(norm(x), torch.nn.functional.layer_norm(x, (24,), norm.weight, norm.bias), rtol=0,
                               atol=0)
    xb = x.bfloat16().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = norm(xb)
    assert out.dtype == torch.bfloat16
    ref = torch.nn.functional.layer_norm(xb.double(), (24,), norm.weight.double(), norm.bias.double())
    assert (out.double() - ref).abs().max() < 3e-2
    out.float().sum().backward()
    assert xb.grad.dtype == torch.bfloat16 and norm.weight.grad.dtype == torch.float32


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_bf16_with_the_triton_kernel_casts_activations_only_at_the_model_boundary():
    """The GPU's default graph kernel (here under Triton's interpreter) reads bf16 nodes and fp32 edge
    attributes as they are: no cast inside the blocks, forward or backward. The smallest graphs (O1 data, 40
    nodes; ico0 hidden, 12): Triton's interpreter runs one program per node in numpy, and where a cast happens
    does not depend on the size."""
    result = _steady_census("graphtransformer", "bf16", "triton", grid="o1", hidden="ico0", warmup=1)
    ours = _ours(result.activation_casts)
    assert all(where.startswith("stormshard/models/encoder_processor_decoder.py") for where in ours), result.table()
    assert sum(ours.values()) <= 3, result.table()
    backward = sum(n for where, n in result.activation_casts.items() if not where.startswith("stormshard/"))
    assert backward <= 3, result.table()  # the backward of the boundary casts (the three above)


def test_blocks_sharing_a_plan_share_its_edge_tensors_on_every_device():
    """The processor's blocks share one plan: its edge index and each chunk's index are the same tensors in
    every block, before and after ``.to(device)`` (here the meta device), so a kernel's structure cached per
    edge index is built once for all blocks (16 blocks x 2 chunks would otherwise be 32 structures)."""
    from stormshard.graphs.builder import GraphConfig, KNNEdges, build_graph
    from stormshard.models.config import ModelConfig
    from stormshard.models.registry import build_model
    from stormshard.models.variables import VariableIndex

    names = ["a", "b", "c"]
    graph = build_graph(GraphConfig(data_grid="o4", hidden="o2", processor=KNNEdges(num_neighbours=4)))
    config = ModelConfig(name="graphtransformer", num_channels=8, processor=dict(num_layers=4, num_heads=2,
                                                                                 num_chunks=2))
    model = build_model(config, graph, VariableIndex.build(names, forcing=[], diagnostic=[]))
    for m in (model, model.to("meta")):
        blocks = list(m.processor.blocks) if hasattr(m.processor, "blocks") else list(m.processor.processor.blocks)
        first = blocks[0]
        for block in blocks[1:]:
            assert block.plan.edge_index is first.plan.edge_index
            assert all(block.chunk_index[k] is first.chunk_index[k] for k in first.chunk_index)
            assert all(a[2] is b[2] for a, b in zip(block.edge_chunks, first.edge_chunks, strict=True))
        assert first.plan.edge_index.device.type == next(m.parameters()).device.type


def test_the_cuda_step_copies_no_window_attention_activation(monkeypatch):
    """On the kernels a CUDA step runs (fake tensors: the Triton graph kernel's Python, flex by its contract),
    the processor's attention copies nothing forward (q, k, v are views of ``lin_qkv``'s output, flex's output
    is read in place by the projection) and its backward writes each layer's q, k, v gradient once (one stack).
    Before: three contiguous copies of q, k, v per layer, one of the output, and the gradient's (at the AIFS
    size 14.7 GiB of copies per step, now 4.6)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    result = step_census.cuda_path_census("tiny")
    size = step_census.cuda_path_size("tiny")
    ours = {where: n for where, n in result.copy_bytes.items() if where.startswith("stormshard/")}
    assert not [w for w in ours if w.startswith(("stormshard/layers/attention.py", "stormshard/kernels/flex.py",
                                                  "stormshard/layers/transformer.py"))], result.table()
    backward = {where: n for where, n in result.copy_bytes.items() if not where.startswith("stormshard/")}
    qkv_gradient = size["hidden_nodes"] * 3 * size["channels"] * 2  # bf16
    assert sum(backward.values()) == size["layers"] * qkv_gradient, result.table()
    assert all("(stack)" in where for where in backward), result.table()
