"""The Triton graph-attention kernels (stormshard.kernels.graph_triton) against the float64 reference.

Run on a CPU by Triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py when CUDA is
absent; the kernels run on CUDA tensors when it is present). Reference: ``graph_attention`` with
the edge embedding ``Linear(edge_attr)`` formed per edge, in float64. Forward and every gradient
(query, key, value, edge attributes, edge weight and bias) on random graphs with destinations
without edges, one destination with ~100 edges among many with 0-2, duplicated and unsorted edges,
bipartite node sets; 1, 3 and 16 heads, head sizes 8, 12, 24, 64, 1, 3, 7 edge features, no batch
and a batch of 2 with shared or per-batch attributes; float64, float32, bf16 / fp16 inputs with
fp32 attributes and weights (autocast's mix). Also: deterministic gradients, no edges, no
destinations, the structure cache, the reason given without the interpreter, torch.compile, and
the input errors. Shapes are small: the interpreter runs every program in numpy.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from stormshard.kernels import graph_triton as gt  # noqa: E402
from stormshard.kernels.graph_csr import fused_graph_attention  # noqa: E402
from stormshard.kernels.reference import graph_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if gt.triton_graph_unavailable(DEVICE) is not None:  # pragma: no cover - conftest sets the interpreter
    pytest.skip(gt.triton_graph_unavailable(DEVICE), allow_module_level=True)

NAMES = ("query", "key", "value", "edge_attr", "edge_weight", "edge_bias")


def uneven_graph(num_src: int, num_dst: int, hub_edges: int, seed: int) -> torch.Tensor:
    """``(2, E)``: destination 1 has ``hub_edges`` edges, the others 0-2 (the last one none), then a
    fifth of the edges duplicated and the whole shuffled."""
    g = torch.Generator().manual_seed(seed)
    degree = torch.randint(0, 3, (num_dst,), generator=g)
    degree[1], degree[-1] = hub_edges, 0
    dst = torch.repeat_interleave(torch.arange(num_dst), degree)
    src = torch.randint(0, num_src, (dst.numel(),), generator=g)
    dup = torch.randint(0, dst.numel(), (dst.numel() // 5,), generator=g)
    edges = torch.stack([torch.cat([src, src[dup]]), torch.cat([dst, dst[dup]])])
    return edges[:, torch.randperm(edges.shape[1], generator=g)]


def make_inputs(num_src: int, num_dst: int, heads: int, d: int, fdim: int, batch: tuple[int, ...] = (),
                attr_batched: bool = False, bias: bool = True, hub_edges: int = 100, seed: int = 0,
                dtype: torch.dtype = torch.float64, param_dtype: torch.dtype | None = None):  # noqa: ANN201
    """``(inputs, edge_index, grad_out)``: ``inputs`` the six tensor arguments by name (leaves that
    require grad; ``edge_bias`` None without ``bias``), node tensors in ``dtype``, attributes and
    weights in ``param_dtype`` (default ``dtype``)."""
    g = torch.Generator().manual_seed(seed)
    edge_index = uneven_graph(num_src, num_dst, hub_edges, seed)
    num_edges = edge_index.shape[1]
    param_dtype = param_dtype or dtype
    shapes = dict(query=(num_dst, *batch, heads, d), key=(num_src, *batch, heads, d),
                  value=(num_src, *batch, heads, d), edge_attr=(num_edges, *(batch if attr_batched else ()), fdim),
                  edge_weight=(heads * d, fdim), edge_bias=(heads * d,))
    inputs = {}
    for name, shape in shapes.items():
        kind = param_dtype if name.startswith("edge") else dtype
        scale = 1.0 / fdim**0.5 if name == "edge_weight" else 1.0
        inputs[name] = (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(kind).requires_grad_(True)
    if not bias:
        inputs["edge_bias"] = None
    grad_out = torch.randn(shapes["query"], generator=g, dtype=torch.float64).to(dtype)
    return inputs, edge_index, grad_out


def run(fn, inputs: dict, edge_index: torch.Tensor, grad_out: torch.Tensor):  # noqa: ANN001, ANN201
    """``(output, {name: gradient})`` of ``fn`` (a kernel's signature) on ``inputs`` moved to DEVICE."""
    leaves = {n: t for n, t in inputs.items() if t is not None and t.requires_grad}
    moved = {n: None if t is None else t.to(DEVICE) for n, t in inputs.items()}
    out = fn(*(moved[n] for n in NAMES), edge_index.to(DEVICE), grad_out.shape[0])
    grads = torch.autograd.grad(out, list(leaves.values()), grad_out.to(DEVICE))
    return out.cpu(), {n: gr.cpu() for n, gr in zip(leaves, grads, strict=True)}


def reference(query, key, value, edge_attr, edge_weight, edge_bias, edge_index, num_dst):  # noqa: ANN001, ANN201
    """The per-edge float64 reference: ``Linear(edge_attr)`` split into heads, added to keys and values."""
    heads, d = query.shape[-2:]
    emb = edge_attr.double() @ edge_weight.double().t()
    if edge_bias is not None:
        emb = emb + edge_bias.double()
    emb = emb.unflatten(-1, (heads, d))
    emb = emb.view(emb.shape[0], *([1] * (key.dim() - emb.dim())), *emb.shape[1:])  # shared by the batch
    return graph_attention(query.double(), key.double(), value.double(), emb, edge_index, num_dst)


def rounded(inputs: dict) -> dict:
    """Detached float64 copies of ``inputs`` (the values a low-precision input holds), as leaves."""
    return {n: None if t is None else t.detach().double().requires_grad_(True) for n, t in inputs.items()}


def rel_errors(out, grads, ref_out, ref_grads) -> dict[str, float]:  # noqa: ANN001
    """Max absolute error over max magnitude, per output and gradient."""
    pairs = {"out": (out, ref_out), **{n: (grads[n], ref_grads[n]) for n in ref_grads}}
    return {n: ((a.double() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item() for n, (a, b) in pairs.items()}


CASES = {
    "3 heads, d 12, 3 features, bipartite": dict(num_src=13, num_dst=11, heads=3, d=12, fdim=3),
    "16 heads, d 8, 1 feature, batch 2 shared attrs": dict(num_src=9, num_dst=9, heads=16, d=8, fdim=1, batch=(2,)),
    "1 head, d 64, 7 features, batch 2 per-batch attrs": dict(num_src=8, num_dst=10, heads=1, d=64, fdim=7,
                                                               batch=(2,), attr_batched=True),
    "16 heads, d 24, 3 features, no bias": dict(num_src=7, num_dst=5, heads=16, d=24, fdim=3, bias=False),
    # 3 destinations (one without edges, the hub with 20 edges: 3 tiles), 3 sources: the interpreter runs a program
    # per destination, head group (4 of them) and batch entry (4), and loops over the 17 columns of W in each
    "16 heads, d 64, 16 features, batch (2, 2)": dict(num_src=3, num_dst=3, heads=16, d=64, fdim=16, batch=(2, 2),
                                                     attr_batched=True, hub_edges=20),
    # 2 head groups of 4 (tile_config), the second one half empty; attributes shared by the batch
    "6 heads, d 64, 2 features, batch 2 shared attrs": dict(num_src=6, num_dst=7, heads=6, d=64, fdim=2, batch=(2,),
                                                           hub_edges=30),
}


@pytest.mark.parametrize("name", list(CASES))
def test_float64_matches_reference(name):
    inputs, edge_index, grad_out = make_inputs(**CASES[name])
    out, grads = run(gt.triton_graph_attention, inputs, edge_index, grad_out)
    ref_out, ref_grads = run(reference, inputs, edge_index, grad_out)
    assert out.dtype == torch.float64 and out.shape == grad_out.shape
    errors = rel_errors(out, grads, ref_out, ref_grads)
    assert max(errors.values()) < 1e-10, errors
    empty = torch.ones(grad_out.shape[0], dtype=torch.bool)
    empty[edge_index[1]] = False
    assert empty.any() and torch.all(out[empty] == 0)


def test_float32_matches_reference():
    inputs, edge_index, grad_out = make_inputs(num_src=9, num_dst=8, heads=3, d=24, fdim=7, batch=(2,),
                                               dtype=torch.float32, seed=1)
    out, grads = run(gt.triton_graph_attention, inputs, edge_index, grad_out)
    ref_out, ref_grads = run(reference, rounded(inputs), edge_index, grad_out.double())
    assert out.dtype == torch.float32 and all(grads[n].dtype == torch.float32 for n in grads)
    errors = rel_errors(out, grads, ref_out, ref_grads)
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize("dtype, heads, d", [(torch.bfloat16, 3, 24), (torch.float16, 3, 24), (torch.bfloat16, 6, 64)],
                         ids=["bf16", "fp16", "bf16 head groups"])
def test_half_inputs_with_fp32_parameters(dtype, heads, d):
    """Autocast's mix: bf16 / fp16 nodes, fp32 attributes and weights, read as they are. Errors against
    the float64 reference of the same (rounded) values are those of rounding the results, and no worse
    than the csr kernel's on fp32 copies of the same inputs (the dispatcher's csr path) up to a factor
    2: Triton's interpreter converts fp32 to bf16 by truncation (a GPU rounds to nearest, as torch)."""
    inputs, edge_index, grad_out = make_inputs(num_src=9, num_dst=8, heads=heads, d=d, fdim=3, batch=(2,),
                                               dtype=dtype, param_dtype=torch.float32, seed=2)
    out, grads = run(gt.triton_graph_attention, inputs, edge_index, grad_out)
    assert out.dtype == dtype
    assert all(grads[n].dtype == inputs[n].dtype for n in grads)
    ref_out, ref_grads = run(reference, rounded(inputs), edge_index, grad_out.double())
    errors = rel_errors(out, grads, ref_out, ref_grads)
    assert max(errors.values()) < 3e-2, errors

    def csr(*args):  # noqa: ANN002, ANN202
        tensors, rest = args[:6], args[6:]
        return fused_graph_attention(*(None if t is None else t.float() for t in tensors), *rest).to(dtype)

    csr_out, csr_grads = run(csr, inputs, edge_index, grad_out)
    csr_errors = rel_errors(csr_out, {n: g.to(inputs[n].dtype) for n, g in csr_grads.items()}, ref_out, ref_grads)
    # truncating instead of rounding the results costs up to half a unit in the last place more: 2^-8 in bf16
    slack = 2.0**-8 if dtype == torch.bfloat16 else 1e-3
    for n, err in errors.items():
        assert err <= 2 * csr_errors[n] + slack, (n, errors, csr_errors)


def test_bf16_keys_and_values_accumulate_in_fp32():
    """bf16 keys and values with an fp32 query: an fp32 output within fp32 rounding of the float64
    reference of the same values (bf16 logits or sums would be off by ~1e-2)."""
    inputs, edge_index, grad_out = make_inputs(num_src=9, num_dst=8, heads=3, d=12, fdim=3, dtype=torch.float32,
                                               seed=6)
    for name in ("key", "value"):
        inputs[name] = inputs[name].detach().bfloat16().requires_grad_(True)
    out, grads = run(gt.triton_graph_attention, inputs, edge_index, grad_out)
    assert out.dtype == torch.float32 and grads["key"].dtype == torch.bfloat16
    ref_out, ref_grads = run(reference, rounded(inputs), edge_index, grad_out.double())
    errors = rel_errors(out, grads, ref_out, ref_grads)
    assert max(errors[n] for n in errors if n not in ("key", "value")) < 1e-5, errors


@pytest.mark.parametrize("heads, d, features", [(1, 8, 0), (3, 12, 3), (16, 64, 11), (16, 64, 3), (16, 128, 3),
                                                (12, 64, 3), (6, 64, 1), (16, 8, 16), (2, 512, 1)])
def test_tile_config_covers_the_heads_in_groups(heads, d, features):
    """Programs own ``HP`` heads (a power of two, ``HP * DP`` at most 256 where a head fits), ``G`` of them
    cover every head with less than one group of padding, and tiles hold about 2K elements."""
    cfg = gt.tile_config(heads, d, features)
    hp, groups, dp, fp = cfg["HP"], cfg["G"], cfg["DP"], cfg["FP"]
    assert hp & (hp - 1) == 0 and dp & (dp - 1) == 0 and fp & (fp - 1) == 0
    assert dp >= d > dp // 2 and fp >= features + 1 > fp // 2
    assert hp * dp <= max(256, dp) and (groups - 1) * hp < heads <= groups * hp
    assert 2 <= cfg["BLOCK_E"] <= 64 and cfg["BLOCK_E"] * hp * dp <= max(2048, 2 * hp * dp)
    for degree in (0.5, 1, 3, 4.2, 16, 1000):  # a node's edges fill its tiles: the cap at the degree's power of two
        capped = gt.tile_config(heads, d, features, degree)
        assert capped["BLOCK_E"] == min(cfg["BLOCK_E"], max(2, 1 << (math.ceil(degree) - 1).bit_length())), degree
        assert (capped["HP"], capped["G"]) == (hp, groups)  # the head groups (and the dattr layout) stay
        assert 2 <= capped["num_warps"] <= cfg["num_warps"]
    aifs_decoder = gt.tile_config(16, 64, 11, 543_088 * 3 / 543_088)
    assert (aifs_decoder["BLOCK_E"], aifs_decoder["num_warps"]) == (4, 4)


def test_every_tile_override_computes_the_same_function():
    """The benchmark's tile sweep (``tile_override``): one head per program with 2-edge tiles, all heads in one
    program, and 2 or 4 nodes per program equal the float64 reference like the default tiles; bad tiles are an
    error."""
    inputs, edge_index, grad_out = make_inputs(num_src=3, num_dst=5, heads=6, d=24, fdim=2, batch=(2,), hub_edges=9,
                                               seed=8)
    ref_out, ref_grads = run(reference, inputs, edge_index, grad_out)
    # several nodes per program, the last block partly past the 5 destinations and 3 sources (at 2 and 4 nodes per
    # program both); the hub's 9 edges walk several tiles
    for tiles in (gt.Tiles(1, 2, 2), gt.Tiles(8, 4, 4), gt.Tiles(4, 2, 2, 4), gt.Tiles(2, 4, 2, 2)):
        with gt.tile_override(tiles):
            assert gt.tile_config(6, 24, 2)["HP"] == tiles.heads_per_program
            out, grads = run(gt.triton_graph_attention, inputs, edge_index, grad_out)
        errors = rel_errors(out, grads, ref_out, ref_grads)
        assert max(errors.values()) < 1e-10, (tiles, errors)
    assert gt.tile_config(6, 24, 2)["HP"] == 8  # the override ends with its block
    with pytest.raises(ValueError, match="block_e = 3: must be a power of two"):
        gt.Tiles(2, 3, 4)
    with pytest.raises(ValueError, match="nodes_per_program = 3: must be a power of two"):
        gt.Tiles(2, 2, 4, 3)


def test_gradients_of_some_inputs_only():
    """Constant edge attributes and weights (buffers, frozen layers): only the other gradients."""
    inputs, edge_index, grad_out = make_inputs(num_src=6, num_dst=5, heads=3, d=8, fdim=3, batch=(2,), seed=7)
    for name in ("edge_attr", "edge_weight"):
        inputs[name] = inputs[name].detach()
    out, grads = run(gt.triton_graph_attention, {**inputs, "key": inputs["key"].detach()}, edge_index, grad_out)
    ref_out, ref_grads = run(reference, inputs, edge_index, grad_out)
    assert set(grads) == {"query", "value", "edge_bias"}
    errors = rel_errors(out, grads, ref_out, {n: ref_grads[n] for n in grads})
    assert max(errors.values()) < 1e-10, errors


@pytest.mark.parametrize("heads, d", [(3, 12), (6, 64)], ids=["one head group", "head groups"])
def test_backward_is_deterministic(heads, d):
    # a destination with 24 edges (3 tiles of 8 at 6 heads of 64, more at 3 of 12), 4 per source on average: the
    # float32 sums run over many terms in every kernel (smaller than the default hub: the interpreter is slow)
    inputs, edge_index, grad_out = make_inputs(num_src=6, num_dst=3, heads=heads, d=d, fdim=3, batch=(2,),
                                               hub_edges=24, dtype=torch.float32, seed=3)
    first = run(gt.triton_graph_attention, inputs, edge_index, grad_out)
    second = run(gt.triton_graph_attention, inputs, edge_index, grad_out)
    assert torch.equal(first[0], second[0])
    assert all(torch.equal(first[1][n], second[1][n]) for n in first[1])


@pytest.mark.parametrize("num_dst", [4, 0])
def test_no_edges_gives_zeros_and_zero_grads(num_dst):
    inputs, edge_index, grad_out = make_inputs(num_src=5, num_dst=4, heads=2, d=8, fdim=3, hub_edges=0)
    inputs["query"] = inputs["query"].detach()[:num_dst].requires_grad_(True)
    edge_index, inputs["edge_attr"] = edge_index[:, :0], inputs["edge_attr"].detach()[:0].requires_grad_(True)
    out, grads = run(gt.triton_graph_attention, inputs, edge_index, grad_out[:num_dst])
    assert out.shape == (num_dst, 2, 8) and torch.all(out == 0)
    assert set(grads) == set(NAMES) and all(torch.all(g == 0) for g in grads.values())


def test_destinations_without_edges_overall():
    """Edges into one destination only, a graph with more sources than edges, and a wide batch."""
    edge_index = torch.tensor([[4, 0, 4], [2, 2, 2]])
    inputs, _, grad_out = make_inputs(num_src=6, num_dst=4, heads=3, d=8, fdim=1, batch=(3,), hub_edges=0)
    inputs["edge_attr"] = torch.randn(3, 1, dtype=torch.float64, requires_grad=True)
    out, grads = run(gt.triton_graph_attention, inputs, edge_index, grad_out)
    ref_out, ref_grads = run(reference, inputs, edge_index, grad_out)
    errors = rel_errors(out, grads, ref_out, ref_grads)
    assert max(errors.values()) < 1e-10, errors
    assert torch.all(out[[0, 1, 3]] == 0) and torch.all(grads["key"][[1, 2, 3, 5]] == 0)


def test_structure_is_built_once_per_edge_index():
    inputs, edge_index, grad_out = make_inputs(num_src=5, num_dst=4, heads=2, d=8, fdim=1, hub_edges=3, seed=4)
    edge_index = edge_index.to(DEVICE)
    before = gt.structure_builds()
    first = run(gt.triton_graph_attention, inputs, edge_index, grad_out)
    run(gt.triton_graph_attention, inputs, edge_index, grad_out)
    assert gt.structure_builds() == before + 1  # forward and backward of two calls: one build
    assert gt.triton_graph_structure(edge_index, 5, 4) is gt.triton_graph_structure(edge_index, 5, 4)
    assert gt.triton_graph_structure(edge_index, 5, 4).dst_nbr.dtype == torch.int32
    edge_index[0] = (edge_index[0] + 1) % 5  # in place: a new version, rebuilt
    changed = run(gt.triton_graph_attention, inputs, edge_index, grad_out)
    assert gt.structure_builds() == before + 2 and not torch.equal(first[0], changed[0])


def test_unavailable_without_interpreter_on_cpu():
    """Without ``TRITON_INTERPRET`` a CPU gets a reason naming the fix, CUDA none; without Triton both
    get one (the module itself imports without it)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys; sys.modules['triton'] = None\n"
            "from stormshard.kernels.graph_triton import triton_graph_unavailable as u\n"
            "print(u('cuda')); del sys.modules['triton']; print(u('cpu')); print(u('cuda'))")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    without_triton, on_cpu, on_cuda = result.stdout.strip().splitlines()
    assert "pip install triton" in without_triton
    assert "TRITON_INTERPRET=1" in on_cpu and "CUDA" in on_cpu
    assert on_cuda == "None"
    if DEVICE == "cpu":
        assert gt.triton_graph_unavailable("cpu") is None  # this process runs the interpreter


def test_compiled_call_has_no_graph_break_and_equals_eager():
    import torch._dynamo

    inputs, edge_index, grad_out = make_inputs(num_src=6, num_dst=5, heads=2, d=8, fdim=3, hub_edges=4,
                                               dtype=torch.float32, seed=5)

    def block(query, key, value, edge_attr, edge_weight, edge_bias, edge_index, num_dst):  # noqa: ANN001, ANN202
        return gt.triton_graph_attention(query * 2, key, value, edge_attr, edge_weight, edge_bias, edge_index,
                                         num_dst).relu()

    moved = [inputs[n].detach().to(DEVICE) for n in NAMES]
    explain = torch._dynamo.explain(block)(*moved, edge_index.to(DEVICE), 5)
    assert explain.graph_break_count == 0 and explain.graph_count == 1, explain.break_reasons
    torch._dynamo.reset()
    eager = run(block, inputs, edge_index, grad_out)
    builds = gt.structure_builds()
    compiled = run(torch.compile(block, backend="aot_eager", fullgraph=True), inputs, edge_index, grad_out)
    assert gt.structure_builds() == builds  # the compiled ops see the same edge_index tensor: cached
    torch.testing.assert_close(compiled[0], eager[0], rtol=0, atol=0)
    for n in eager[1]:
        torch.testing.assert_close(compiled[1][n], eager[1][n], rtol=0, atol=0)


def test_bad_inputs_raise():
    inputs, edge_index, _ = make_inputs(num_src=5, num_dst=4, heads=2, d=8, fdim=3, hub_edges=3)
    q, k, v, attr, w, b = (inputs[n].detach() for n in NAMES)
    with pytest.raises(ValueError, match="edge_weight"):
        gt.triton_graph_attention(q, k, v, attr, w[:, :2], b, edge_index, 4)
    with pytest.raises(ValueError, match="edge_attr has"):
        gt.triton_graph_attention(q, k, v, attr[:3], w, b, edge_index, 4)
    with pytest.raises(ValueError, match="num_dst"):
        gt.triton_graph_attention(q, k, v, attr, w, b, edge_index, 5)
    with pytest.raises(ValueError, match="edge_attr batch dims"):
        gt.triton_graph_attention(q, k, v, attr.unsqueeze(1).expand(-1, 3, -1), w, b, edge_index, 4)
    with pytest.raises(ValueError, match="outside"):
        gt.triton_graph_attention(q, k[:1], v[:1], attr, w, b, edge_index.clone(), 4)


def test_the_dispatch_chooses_and_refuses():
    from stormshard.kernels.dispatch import check_graph_kernel, graph_kernel_problem, resolve_graph_kernel

    assert resolve_graph_kernel("auto", "cpu") == "csr"  # CPU defaults stay csr, interpreter or not
    assert resolve_graph_kernel("csr", "cuda") == "csr"
    assert resolve_graph_kernel("auto", "cuda", torch.float64) == "csr"  # float64: the reference precision
    assert resolve_graph_kernel("triton", "cpu") == "triton"  # TRITON_INTERPRET=1 here (tests/conftest.py)
    assert graph_kernel_problem("triton", "cpu") is None and graph_kernel_problem("csr", "cpu") is None
    assert "unknown" in graph_kernel_problem("cusparse", "cuda")
    with pytest.raises(ValueError, match=r"graph_kernel must be one of 'auto', 'csr', 'triton', got 'fast'"):
        check_graph_kernel("fast")
