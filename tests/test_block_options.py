"""anemoi-models' ``qk_norm`` and gated MLPs (``mlp_implementation``) in stormshard's layers, float64, against the
formulas written out: the MLP kinds (``fc1``'s interleaved gate / value rows), the row-chunked MLP's gated path
(eager and compiled) against the plain one, the sliding-window attention and the graph-transformer block with
query / key norms, and the tensor-parallel block without sequence parallelism (2 ranks: the norms' weight
gradients complete on every rank). The sharded models: ``tests/test_models.py`` (``*-qk-gated`` cases)."""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from stormshard.layers.attention import SlidingWindowAttention
from stormshard.layers.graph_transformer import GraphTransformerMapperBlock, GraphTransformerProcessorBlock
from stormshard.layers.mlp import MLP, GatedActivation, mlp_hidden_width
from stormshard.layers.mlp_kinds import GATED_KINDS, MLP_KINDS
from stormshard.layers.row_chunked_mlp import RowChunkedMLP
from stormshard.layers.tensor_parallel import TensorParallelTransformerBlock
from stormshard.layers.transformer import TransformerBlock
from stormshard.parallel.graph import GraphShardPlan
from stormshard.parallel.partition import get_partition
from tests.distributed import run_distributed

GATES = {"glu": torch.sigmoid, "swiglu": F.silu, "geglu": F.gelu, "reglu": torch.relu}


def _randomise(module: torch.nn.Module, seed: int = 1) -> None:
    """Every parameter random (norm weights away from 1: a swapped q / k norm shows)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.5 + (1.0 if p.dim() == 1 else 0.0))


def _mlp_formula(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor,
                 kind: str) -> torch.Tensor:
    """anemoi's MLP: ``fc2(GELU(fc1 x))``, or ``fc2(act(gate_proj x) * value_proj x)`` with gate rows ``0::2``."""
    if kind == "mlp":
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    gate, value = F.linear(x, w1[0::2], b1[0::2]), F.linear(x, w1[1::2], b1[1::2])
    return F.linear(GATES[kind](gate) * value, w2, b2)


def _ln(t: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None) -> torch.Tensor:
    mean = t.mean(-1, keepdim=True)
    var = ((t - mean) ** 2).mean(-1, keepdim=True)
    out = (t - mean) / torch.sqrt(var + 1e-5)
    return out * (1 if weight is None else weight) + (0 if bias is None else bias)


@pytest.mark.parametrize("kind", MLP_KINDS)
def test_mlp_kinds_equal_the_formula(kind):
    mlp = MLP(6, 1.5, kind=kind).double()
    _randomise(mlp)
    assert mlp.fc2.in_features == 9 and mlp.fc1.out_features == (18 if kind in GATED_KINDS else 9)
    x = torch.randn(3, 5, 6, dtype=torch.float64)
    expect = _mlp_formula(x, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias, kind)
    torch.testing.assert_close(mlp(x), expect, rtol=1e-13, atol=1e-13)
    # anemoi's widths (int(C x ratio + 0.5)) where the product is no half-integer: 2.67 x 16 = 42.72 -> 43
    assert [mlp_hidden_width(16, r) for r in (2.67, 2.75, 4, 0.01)] == [43, 44, 64, 1]
    with pytest.raises(ValueError, match="one of"):
        GatedActivation("mlp")
    with pytest.raises(ValueError, match="mlp_implementation"):
        MLP(6, 2, kind="silu")


@pytest.mark.parametrize("kind", GATED_KINDS)
@pytest.mark.parametrize("compiled", [False, True])
def test_row_chunked_gated_mlp_equals_plain(kind, compiled):
    """The lean path (fc1's output kept, the gate recomputed per row chunk in the backward; the norm inside)
    equals the plain ``nn.Sequential`` after the norm: outputs and every gradient, eager and compiled."""
    torch.manual_seed(0)
    lean = RowChunkedMLP(8, 6, 5, kind=kind, min_elements=0, chunk_elements=3 * 12).double()
    _randomise(lean)
    norm = torch.nn.LayerNorm(8).double()
    _randomise(norm, 2)
    x = torch.randn(4, 3, 8, dtype=torch.float64) * 2  # 12 rows: chunks of 3 rows
    if kind == "reglu":  # keep every gate away from ReLU's kink
        with torch.no_grad():
            lean[0].bias[0::2] += 0.05 * torch.sign(lean[0].bias[0::2])
    params = [x, *lean.parameters(), *norm.parameters()]

    def grads(fn):
        for p in params:
            p.grad = None
        x.requires_grad_(True)
        out = fn()
        (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)).sum().backward()
        return out.detach(), [p.grad.clone() for p in params]

    forward = torch.compile(lean, backend="aot_eager", fullgraph=True) if compiled else lean
    out, got = grads(lambda: forward(x, norm))
    ref, expect = grads(lambda: torch.nn.Sequential.forward(lean, norm(x)))
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    for g, e in zip(got, expect, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-11, atol=1e-12)


def test_row_chunked_gated_mlp_peaks_with_its_fc1_output_only():
    """One gated MLP's forward + backward on real tensors, every storage recorded (``benchmarks/memory_simulation.py``;
    4,000 rows, hidden 256, SwiGLU): the plain one peaks at 6.0 hidden activations (fc1's gate and value, the gate's
    activation, the product, and their gradients), the row-chunked one at 2.25 (fc1's output, a few chunks)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    simulation = importlib.import_module("memory_simulation")
    rows, hidden = 4000, 256
    x = torch.randn(rows, 16, requires_grad=True)
    torch.manual_seed(0)
    lean = RowChunkedMLP(16, hidden, kind="swiglu", min_elements=0, chunk_elements=250 * 2 * hidden)
    plain = RowChunkedMLP(16, hidden, kind="swiglu", min_elements=None)
    plain.load_state_dict(lean.state_dict())
    peaks = {}
    for name, mlp in (("lean", lean), ("plain", plain)):
        def step(mlp: RowChunkedMLP = mlp) -> None:
            mlp(x).square().sum().backward()
            mlp.zero_grad(set_to_none=True)
            x.grad = None

        census = simulation.simulate_step_memory(step, list(mlp.parameters()) + [x], warmup=0).census
        peaks[name] = (census.peak - census.baseline) / (rows * hidden * 4)  # in hidden activations
    assert peaks["plain"] >= 5.5 and peaks["lean"] <= 2.5, peaks


def _window_formula(layer: SlidingWindowAttention, x: torch.Tensor) -> torch.Tensor:
    b, s, c = x.shape
    h, d, w = layer.num_heads, layer.head_dim, layer.window_size
    qkv = F.linear(x, layer.lin_qkv.weight, layer.lin_qkv.bias).reshape(b, s, h, 3, d)
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]  # (b, s, h, d)
    q, k = _ln(q, layer.q_norm.weight), _ln(k, layer.k_norm.weight)
    logits = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(d)
    pos = torch.arange(s)
    logits = logits.masked_fill((pos[:, None] - pos[None, :]).abs() > w, float("-inf"))
    out = torch.einsum("bhij,bjhd->bihd", logits.softmax(-1), v).reshape(b, s, c)
    return F.linear(out, layer.projection.weight, layer.projection.bias)


def test_window_attention_qk_norm_equals_the_formula():
    layer = SlidingWindowAttention(12, 3, 2, qk_norm=True).double()
    _randomise(layer)
    assert layer.q_norm.weight.shape == (4,) and layer.q_norm.bias is None
    x = torch.randn(2, 11, 12, dtype=torch.float64, requires_grad=True)
    out = layer(x)
    expect = _window_formula(layer, x)
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)
    got = torch.autograd.grad(out.square().sum(), (x, layer.q_norm.weight, layer.k_norm.weight))
    ref = torch.autograd.grad(expect.square().sum(), (x, layer.q_norm.weight, layer.k_norm.weight))
    for g, e in zip(got, ref, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-11, atol=1e-11)
    assert set(dict(SlidingWindowAttention(12, 3, 2).named_parameters())) == {
        "lin_qkv.weight", "lin_qkv.bias", "projection.weight", "projection.bias"}  # off: the names as before


def _graph_formula(block: GraphTransformerMapperBlock, x_src: torch.Tensor, x_dst: torch.Tensor, e: torch.Tensor,
                   edge_index: torch.Tensor, norm_src: torch.nn.LayerNorm, norm_dst: torch.nn.LayerNorm,
                   kind: str) -> torch.Tensor:
    """The module docstring's per-edge formula with anemoi's query / key norms (before the edge term)."""
    h, d = block.num_heads, block.hidden_dim // block.num_heads
    hs, hd = _ln(x_src, norm_src.weight, norm_src.bias), _ln(x_dst, norm_dst.weight, norm_dst.bias)
    q = _ln(F.linear(hd, block.to_q.weight, block.to_q.bias).reshape(-1, h, d), block.q_norm.weight)
    k = _ln(F.linear(hs, block.to_k.weight, block.to_k.bias).reshape(-1, h, d), block.k_norm.weight)
    v = F.linear(hs, block.to_v.weight, block.to_v.bias).reshape(-1, h, d)
    emb = F.linear(e, block.to_e.weight, block.to_e.bias).reshape(-1, h, d)
    src, dst = edge_index
    logits = (q[dst] * (k[src] + emb)).sum(-1) / math.sqrt(d)  # (E, h)
    rows = []
    for i in range(x_dst.shape[0]):
        mine = dst == i
        if not bool(mine.any()):
            rows.append(torch.zeros(h * d, dtype=x_dst.dtype))
            continue
        a = logits[mine].softmax(0)
        rows.append((a[..., None] * (v[src[mine]] + emb[mine])).sum(0).reshape(-1))
    attn = torch.stack(rows) + F.linear(hd, block.to_self.weight, block.to_self.bias)
    x = x_dst + F.linear(attn, block.proj.weight, block.proj.bias)
    mlp = block.mlp
    return x + _mlp_formula(_ln(x, block.norm_mlp.weight, block.norm_mlp.bias), mlp[0].weight, mlp[0].bias,
                            mlp[2].weight, mlp[2].bias, kind)


@pytest.mark.parametrize("processor", [False, True])
def test_graph_transformer_qk_norm_and_gated_mlp_equal_the_formula(processor):
    g = torch.Generator().manual_seed(0)
    n_src, n_dst, n_edges = (9, 9, 30) if processor else (10, 7, 25)
    edge_index = torch.stack([torch.randint(0, n_src, (n_edges,), generator=g),
                              torch.randint(0, n_dst - 1, (n_edges,), generator=g)])  # the last node: no edges
    kind = "swiglu" if processor else "geglu"
    if processor:
        plan = GraphShardPlan.build(edge_index, n_src)
        block = GraphTransformerProcessorBlock(8, 3, 2, plan, mlp_ratio=1.5, self_projection=True, qk_norm=True,
                                               mlp_kind=kind, num_chunks=2).double()
    else:
        plan = GraphShardPlan.build(edge_index, (n_src, n_dst))
        block = GraphTransformerMapperBlock(6, 8, 3, 2, plan, mlp_ratio=1.5, self_projection=True, qk_norm=True,
                                            mlp_kind=kind).double()
    _randomise(block)
    x_src = torch.randn(n_src, 8 if processor else 6, generator=g, dtype=torch.float64)
    x_dst = x_src if processor else torch.randn(n_dst, 8, generator=g, dtype=torch.float64)
    e = torch.randn(n_edges, 3, generator=g, dtype=torch.float64)
    if processor:
        out = block(x_src, plan.shard_edges(e))[0]
        expect = _graph_formula(block, x_src, x_src, e, edge_index, block.norm, block.norm, kind)
    else:
        out = block(x_src, x_dst, plan.shard_edges(e))
        expect = _graph_formula(block, x_src, x_dst, e, edge_index, block.norm_src, block.norm_dst, kind)
    torch.testing.assert_close(out, expect, rtol=1e-12, atol=1e-12)


def _tensor_parallel_only(rank: int, world: int) -> bool:
    """Without sequence parallelism every rank computes the whole output: every gradient (the replicated query /
    key norms' too, through ``copy_tensor``) is complete on every rank without a sum over the group."""
    torch.manual_seed(0)
    full = TransformerBlock(12, 4, 3, mlp_ratio=1.5, qk_norm=True, mlp_kind="swiglu").double()
    _randomise(full)
    tp = TensorParallelTransformerBlock.from_block(full, group=dist.group.WORLD)
    x = torch.randn(2, 10, 12, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    weight = torch.linspace(-1, 1, x.numel(), dtype=torch.float64).reshape(x.shape)
    (full(x) * weight).sum().backward()
    out = tp(x)
    (out * weight).sum().backward()
    torch.testing.assert_close(out, full(x), rtol=1e-12, atol=1e-12)
    ref = dict(full.named_parameters())
    for name, p in tp.named_parameters():
        part = get_partition(p)
        expect = ref[name].grad if part is None else ref[name].grad.narrow(part.dim, part.offset, p.shape[part.dim])
        torch.testing.assert_close(p.grad, expect, rtol=1e-11, atol=1e-12, msg=name)
    assert get_partition(tp.attention.q_norm.weight) is None and tp.mlp.fc1.weight.shape[0] == 2 * 18 // world
    return True


def test_tensor_parallel_only_block_with_qk_norm_and_gated_mlp():
    assert all(run_distributed(_tensor_parallel_only, 2))
