"""``stormshard.layers.norm_linear`` and the graph-transformer blocks' memory-lean paths: linear maps of a
layer-normed input that keep the input equal ``[linear(norm(x))]`` (float64 exactly, bf16 under autocast, any
subset of outputs and gradients, compiled), keep one activation fewer, and blocks built on them (and on the
row-chunked MLP with its norm inside) equal the plain blocks."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import stormshard.layers.norm_linear as norm_linear_module
from stormshard.layers.norm import LayerNorm
from stormshard.layers.norm_linear import keeps_norm_input, norm_linear
from tests.test_graph_layers import force_lean_paths, make_block, make_inputs, make_plan, run_block


def _modules(channels: int = 12, dtype=torch.float64):
    torch.manual_seed(0)
    norm = LayerNorm(channels).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    return norm, nn.Linear(channels, 8).to(dtype), nn.Linear(channels, 5, bias=False).to(dtype)


def _grads(tensors):  # noqa: ANN001, ANN202
    out = [None if t.grad is None else t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return out


@pytest.mark.parametrize("use", ["both", "first", "second"])
def test_equals_the_plain_composition_in_float64(use):
    norm, l1, l2 = _modules()
    x = torch.randn(30, 2, 12, dtype=torch.float64, requires_grad=True)
    leaves = [x, norm.weight, norm.bias, l1.weight, l1.bias, l2.weight]
    w1, w2 = torch.randn(30, 2, 8, dtype=torch.float64), torch.randn(30, 2, 5, dtype=torch.float64)

    def loss(a, b):  # noqa: ANN001, ANN202
        return {"both": (a * w1).sum() + (b * w2).sum(), "first": (a * w1).sum(), "second": (b * w2).sum()}[use]

    a, b = norm_linear(x, norm, [l1, l2])
    loss(a, b).backward()
    fused = [a.detach(), b.detach(), *_grads(leaves)]
    h = norm(x)
    a, b = l1(h), l2(h)
    loss(a, b).backward()
    plain = [a.detach(), b.detach(), *_grads(leaves)]
    for got, want in zip(fused, plain, strict=True):
        assert (got is None) == (want is None)  # an output without a gradient leaves its weights' at None
        if want is not None:
            torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)


def test_frozen_norm_and_input_without_gradient():
    norm, l1, _ = _modules()
    norm.weight.requires_grad_(False)
    x = torch.randn(17, 12, dtype=torch.float64)
    norm_linear(x, norm, [l1])[0].square().sum().backward()
    fused = _grads([norm.bias, l1.weight, l1.bias])
    l1(norm(x)).square().sum().backward()
    plain = _grads([norm.bias, l1.weight, l1.bias])
    assert norm.weight.grad is None
    for got, want in zip(fused, plain, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-14)


def test_bf16_autocast_equals_the_plain_composition():
    norm, l1, l2 = _modules(dtype=torch.float32)
    x = torch.randn(40, 12, requires_grad=True)
    leaves = [x, norm.weight, norm.bias, l1.weight, l1.bias, l2.weight]
    outs = {}
    for name in ("fused", "plain"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            xb = x.to(torch.bfloat16)
            if name == "fused":
                a, b = norm_linear(xb, norm, [l1, l2])
            else:
                h = norm(xb)
                a, b = l1(h), l2(h)
        assert a.dtype == b.dtype == torch.bfloat16
        (a.float().sin().sum() + b.float().sum()).backward()
        outs[name] = [a.detach(), b.detach(), *_grads(leaves)]
    for got, want in zip(outs["fused"], outs["plain"], strict=True):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_compiled_equals_eager_and_keeps_the_input_not_the_normed_copy():
    norm, l1, l2 = _modules(channels=16, dtype=torch.float32)
    x = torch.randn(200, 16, requires_grad=True)

    def fused(t):  # noqa: ANN001, ANN202
        a, b = norm_linear(t, norm, [l1, l2])
        return a.sum() + b.square().sum()

    def saved(fn):  # noqa: ANN001, ANN202
        sizes: list[int] = []

        def pack(t: torch.Tensor) -> torch.Tensor:
            sizes.append(t.numel() * t.element_size())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            fn(x).backward()
        return sizes, _grads([x, norm.weight, norm.bias, l1.weight, l1.bias, l2.weight])

    eager_sizes, eager = saved(fused)
    compiled_sizes, compiled = saved(torch.compile(fused, backend="aot_eager", fullgraph=True))
    plain_sizes, _ = saved(lambda t: l1(norm(t)).sum() + l2(norm(t)).square().sum())
    for got, want in zip(compiled, eager, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    activation = 200 * 16 * 4
    assert sum(eager_sizes) == sum(compiled_sizes)
    assert sum(eager_sizes) < activation * 2  # x (and the small statistics, the weights), no normed copy
    assert sum(plain_sizes) - sum(eager_sizes) >= activation


def test_bad_norm():
    _, l1, _ = _modules()
    with pytest.raises(ValueError, match="normalized_shape"):
        norm_linear(torch.randn(3, 12, dtype=torch.float64), LayerNorm(6).double(), [l1])


def test_threshold():
    limit = norm_linear_module.MIN_ELEMENTS
    assert keeps_norm_input(torch.empty(limit)) and keeps_norm_input(torch.empty(3), 3)
    assert not keeps_norm_input(torch.empty(limit - 1)) and not keeps_norm_input(torch.empty(limit), None)
    with torch.no_grad():
        assert not keeps_norm_input(torch.empty(limit))


def test_lean_activations_setting_binds_the_blocks_thresholds():
    """``model.lean_activations`` (default true) reaches every graph-transformer block and the head at
    construction; false: the plain composition at every size."""
    from stormshard.layers.row_chunked_mlp import MIN_ELEMENTS as MLP_MIN
    from stormshard.models.registry import build_model
    from tests.test_models import VARIABLES, _config, _graph

    config, _ = _config("graphtransformer")
    graph = _graph(config.uses_graph_processor)
    for lean, norm_min, mlp_min in ((True, norm_linear_module.MIN_ELEMENTS, MLP_MIN), (False, None, None)):
        model = build_model(config.model_copy(update={"lean_activations": lean}), graph, VARIABLES)
        blocks = [m for m in model.modules() if hasattr(m, "norm_linear_min")]
        assert len(blocks) == 2 + config.processor.num_layers  # encoder, decoder, processor blocks
        assert {b.norm_linear_min for b in blocks} == {norm_min} and model.head_norm_linear_min == norm_min
        assert {b.mlp.min_elements for b in blocks} == {mlp_min}


@pytest.mark.parametrize("kind", ["transformer_mapper", "transformer_processor", "transformer_self_mapper",
                                  "transformer_self_processor"])
@pytest.mark.parametrize("num_chunks", [1, 3])
def test_blocks_on_the_lean_paths_equal_the_plain_blocks(kind, num_chunks):
    """One process (no halo: keys and values by norm_linear too), every lean path forced on at these small sizes:
    the norms inside the projections and inside the row-chunked MLP (7-row chunks)."""
    num_src, num_dst = (53, 53) if kind.endswith("processor") else (61, 45)
    inputs = make_inputs(kind, num_src, num_dst, 300, num_dst - 6, seed=7)
    edge_index, x_src, x_dst, edge_attr, w_nodes, _ = inputs
    results = {}
    for lean in (False, True):
        plan = make_plan(kind, edge_index, num_src, num_dst)
        block = make_block(kind, plan, num_chunks)
        if lean:
            force_lean_paths(block)
        xs = x_src.clone().requires_grad_()
        xd = xs if kind.endswith("processor") else x_dst.clone().requires_grad_()
        ea = edge_attr.clone().requires_grad_()
        nodes, _ = run_block(block, kind, xs, xd, plan.shard_edges(ea))
        (nodes * w_nodes).sum().backward()
        results[lean] = [nodes.detach(), xs.grad, xd.grad, ea.grad] + [p.grad for _, p in block.named_parameters()]
    for got, want in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12)


def test_one_process_model_on_the_lean_paths_equals_the_plain_model():
    """One process, so the encoder's keys and values take norm_linear too (no halo), with the decoder's queries, the
    head and every MLP: the whole model's outputs and gradients equal the plain model's (float64)."""
    from stormshard.models.registry import build_model
    from tests.test_models import VARIABLES, _config, _graph

    config, _ = _config("graphtransformer-anemoi")
    graph = _graph(config.uses_graph_processor)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 2, graph["data"].num_nodes, len(VARIABLES.input_names), generator=g, dtype=torch.float64)
    results = {}
    for lean in (False, True):
        torch.manual_seed(7)
        model = build_model(config, graph, VARIABLES).double()
        if lean:
            assert force_lean_paths(model) > 0
        out = model(x)
        out.square().sum().backward()
        results[lean] = [out.detach()] + [p.grad for _, p in model.named_parameters()]
    for got, want in zip(results[True], results[False], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-11)
