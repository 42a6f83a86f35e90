"""Sliding-window attention: kernel, layer and processor equal a dense reference from the definition.

The single-process results and the dense reference are computed here (in the test process);
the ranks run the sharded layer on their slice and return their outputs and gradients, which are
assembled and compared in float64: outputs, input gradients and parameter gradients (summed over
the ranks, whose replicas each see part of the loss).
"""

from __future__ import annotations

import itertools
import math

import einops
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from stormshard.kernels.dispatch import sliding_window_attention
from stormshard.kernels.reference import dense_window_attention
from stormshard.layers.attention import SlidingWindowAttention, split_qkv
from stormshard.layers.checkpointing import ActivationCheckpoint
from stormshard.layers.conditional import ConditionalTransformerBlock
from stormshard.layers.mlp import MLP
from stormshard.layers.transformer import TransformerBlock, TransformerProcessor
from stormshard.models.parallelize import build_transformer_processor
from stormshard.parallel.counter import CommCounter
from stormshard.parallel.shapes import balanced_offsets, balanced_sizes
from stormshard.parallel.shard import SequenceShard
from tests.distributed import run_distributed

F64 = torch.float64
TIGHT = {"rtol": 1e-10, "atol": 1e-11}


def _rand(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


# ------------------------------------------------------------------------------------------
# dense references written from the definition (no einops, no window kernel)
# ------------------------------------------------------------------------------------------


def _dense_attention_layer(layer: SlidingWindowAttention, x):
    """|i - j| <= window in a dense (N, N) mask; lin_qkv outputs ordered (heads, 3, head_dim)."""
    b, n, c = x.shape
    h, d = layer.num_heads, c // layer.num_heads
    qkv = F.linear(x, layer.lin_qkv.weight, layer.lin_qkv.bias).view(b, n, h, 3, d).permute(3, 0, 2, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    pos = torch.arange(n)
    allowed = (pos[:, None] - pos[None, :]).abs() <= layer.window_size
    scores = (q @ k.transpose(-1, -2)) / math.sqrt(d)
    weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    out = (weights @ v).permute(0, 2, 1, 3).reshape(b, n, c)
    return F.linear(out, layer.projection.weight, layer.projection.bias)


def _dense_block(block: TransformerBlock, x):
    a = block.norm_attention
    x = x + _dense_attention_layer(block.attention, F.layer_norm(x, a.normalized_shape, a.weight, a.bias, a.eps))
    m = block.norm_mlp
    y = F.layer_norm(x, m.normalized_shape, m.weight, m.bias, m.eps)
    y = F.linear(F.gelu(F.linear(y, block.mlp.fc1.weight, block.mlp.fc1.bias)), block.mlp.fc2.weight, block.mlp.fc2.bias)
    return x + y


def _dense_processor(proc: TransformerProcessor, x):
    for block in proc.blocks:
        x = _dense_block(block, x)
    return x


# ------------------------------------------------------------------------------------------
# the window kernel
# ------------------------------------------------------------------------------------------


def test_kernel_matches_dense_with_offsets():
    g = torch.Generator().manual_seed(0)
    cases = itertools.product([1, 6, 37], [1, 41], [0, 1, 3, 10, 100], [0, 3, 45], [0, -5], [None, 4])
    for lq, lk, w, q_off, k_off, block in cases:
        q, k, v = (torch.randn(2, 3, n, 4, generator=g, dtype=F64, requires_grad=True) for n in (lq, lk, lk))
        grad = torch.randn(2, 3, lq, 4, generator=g, dtype=F64)
        out = sliding_window_attention(q, k, v, w, q_off, k_off, block_size=block)
        ref = dense_window_attention(q, k, v, w, q_off, k_off)
        torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
        for a, r in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad),
                        strict=True):
            torch.testing.assert_close(a, r, rtol=1e-12, atol=1e-12)


def test_kernel_rows_without_keys_are_zero():
    q, k, v = torch.randn(1, 1, 4, 2, dtype=F64), torch.randn(1, 1, 3, 2, dtype=F64), torch.randn(1, 1, 3, 2, dtype=F64)
    out = sliding_window_attention(q, k, v, 1, q_offset=0, k_offset=3)  # query 0, 1 reach no key
    assert torch.equal(out[..., :2, :], torch.zeros(1, 1, 2, 2, dtype=F64))
    torch.testing.assert_close(out, dense_window_attention(q, k, v, 1, 0, 3))


def test_kernel_gradcheck_and_half_precision():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, n, 3, generator=g, dtype=F64, requires_grad=True) for n in (9, 11, 11))
    assert torch.autograd.gradcheck(lambda a, b, c: sliding_window_attention(a, b, c, 2, 1, 0, block_size=4), (q, k, v))
    q32, k32, v32 = (t.detach().float() for t in (q, k, v))
    ref = sliding_window_attention(q32, k32, v32, 3)
    low = sliding_window_attention(q32.bfloat16(), k32.bfloat16(), v32.bfloat16(), 3)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("dtype", [F64, torch.float32])
def test_cpu_fused_blocks_equal_the_batched_product_blocks(monkeypatch, dtype):
    """On a CPU the banded kernel runs each block in torch's fused CPU flash-attention kernel; the batched-product
    blocks (what CUDA runs in fp32) give the same outputs and gradients: offsets, uneven lengths, rows without
    keys, head sizes that are not powers of two, windows wider than the blocks."""
    from stormshard.kernels import banded

    assert banded._fused_on(torch.empty(1))
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == F64 else {"rtol": 2e-5, "atol": 2e-6}
    cases = [((2, 3), 50, 70, 8, 5, 7, 16), ((1, 2), 33, 33, 5, 40, 0, None), ((2, 2), 130, 150, 16, 3, -20, None),
             ((1, 4), 200, 200, 8, 64, 0, 32), ((1, 1), 12, 9, 3, 1, 30, 4)]
    for (b, h), lq, lk, d, w, shift, block in cases:
        g = torch.Generator().manual_seed(lq + lk)
        q, k, v = (torch.randn(b, h, n, d, generator=g, dtype=dtype, requires_grad=True) for n in (lq, lk, lk))
        grad = torch.randn(b, h, lq, d, generator=g, dtype=dtype)
        results = []
        for fused in (True, False):
            monkeypatch.setattr(banded, "_fused_on", lambda t, fused=fused: fused)
            out = sliding_window_attention(q, k, v, w, q_offset=shift, block_size=block, kernel="banded")
            results.append((out, *torch.autograd.grad(out, (q, k, v), grad)))
        for a, r in zip(*results, strict=True):
            torch.testing.assert_close(a, r, **tol)
        torch.testing.assert_close(results[0][0], dense_window_attention(q, k, v, w, shift, 0).detach(), **tol)


def test_kernel_long_sequence_is_banded():
    # 40k tokens: a dense (Lq, Lk) float64 score matrix would need 12.8 GB; the banded kernel a few MB
    n, w = 40_000, 3
    q, k, v = (torch.randn(1, 1, n, 2, dtype=F64) for _ in range(3))
    out = sliding_window_attention(q, k, v, w)
    for i in (0, 1, 20_000, n - 1):
        lo, hi = max(0, i - w), min(n, i + w + 1)
        ref = dense_window_attention(q[..., i : i + 1, :], k[..., lo:hi, :], v[..., lo:hi, :], w, i, lo)
        torch.testing.assert_close(out[..., i : i + 1, :], ref)


def test_flash_window_mapping():
    """The (left, right) window handed to flash-attn reproduces our offsets under flash's alignment rule."""
    from stormshard.kernels.flash import flash_window_sides

    for num_q, num_k, shift, w in itertools.product([1, 5, 9], [5, 9, 14], [0, 2, 4, 7], [0, 1, 3, 20]):
        if shift + num_q > num_k:
            continue
        sides = flash_window_sides(shift, num_q, num_k, w)
        i, j = torch.arange(num_q)[:, None], torch.arange(num_k)[None, :]
        ours = (i + shift - j).abs() <= w
        if sides is None:
            assert w < abs(shift - (num_k - num_q))
            continue
        left, right = sides
        # flash-attn, non-causal with Lq != Lk: query i sees keys [i + Lk - Lq - left, i + Lk - Lq + right]
        flash = (j >= i + num_k - num_q - left) & (j <= i + num_k - num_q + right)
        assert torch.equal(ours, flash), (num_q, num_k, shift, w)


def test_kernel_saves_only_linear_state_for_backward():
    """Autograd keeps q, k, v, out and the per-query log-sum-exp: no (Lq, Lk) or banded score matrix."""
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    q, k, v = (torch.randn(2, 3, 2048, 8, requires_grad=True) for _ in range(3))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = sliding_window_attention(q, k, v, 256)
    out.sum().backward()
    assert sum(saved) <= 4 * q.numel() + 2 * 3 * 2048  # q, k, v, out and lse (+ slack)


def test_kernel_errors():
    q = torch.zeros(1, 1, 4, 2)
    with pytest.raises(ValueError, match="window_size must be a non-negative int, got -1"):
        sliding_window_attention(q, q, q, -1)
    with pytest.raises(ValueError, match=r"must be \(batch, heads, seq, dim\)"):
        sliding_window_attention(q[0], q, q, 1)
    with pytest.raises(ValueError, match="disagree"):
        sliding_window_attention(q, torch.zeros(1, 1, 4, 3), q, 1)


# ------------------------------------------------------------------------------------------
# single process: layer and processor vs the dense definition
# ------------------------------------------------------------------------------------------


def _make_attention(channels, heads, window, strategy, seed, shard=None):
    torch.manual_seed(seed)
    return SlidingWindowAttention(channels, heads, window, strategy, shard).double()


def _make_processor(layers, channels, heads, window, strategy, checkpointing, seed, shard=None):
    torch.manual_seed(seed)
    return build_transformer_processor(layers, channels, heads, window, mlp_ratio=2, shard_strategy=strategy,
                                       shard=shard, activation_checkpointing=checkpointing).double()


def _single(module, x, grad, dense=None):
    """Output, input gradient and parameter gradients of ``module`` (or of ``dense(module, x)``)."""
    x = x.clone().requires_grad_()
    module.zero_grad()
    out = dense(module, x) if dense else module(x)
    out.backward(grad)
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def _assert_same(a, b, tol=TIGHT):
    torch.testing.assert_close(a[0], b[0], **tol)
    torch.testing.assert_close(a[1], b[1], **tol)
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        torch.testing.assert_close(a[2][name], b[2][name], **tol, msg=lambda m, n=name: f"{n}: {m}")


def test_single_process_layer_and_processor_match_dense():
    for n, window in [(1, 0), (17, 0), (17, 1), (17, 5), (17, 16), (17, 40), (300, 70)]:
        layer = _make_attention(8, 2, window, "shard_sequence", 3)
        x, grad = _rand((2, n, 8), 1), _rand((2, n, 8), 2)
        _assert_same(_single(layer, x, grad), _single(layer, x, grad, _dense_attention_layer))
    for checkpointing in (False, True, "selective"):
        proc = _make_processor(2, 8, 2, 3, "shard_sequence", checkpointing, 4)
        x, grad = _rand((2, 19, 8), 5), _rand((2, 19, 8), 6)
        _assert_same(_single(proc, x, grad), _single(proc, x, grad, _dense_processor))


def test_state_dict_is_strategy_independent():
    a = _make_processor(2, 8, 2, 3, "shard_sequence", False, 0)
    b = _make_processor(2, 8, 2, 3, "shard_heads", True, 1)
    assert {k: v.shape for k, v in a.state_dict().items()} == {k: v.shape for k, v in b.state_dict().items()}
    b.load_state_dict(a.state_dict())
    x = _rand((1, 9, 8), 2)
    torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
    names = set(a.state_dict())
    for expected in ("blocks.0.norm_attention.weight", "blocks.0.attention.lin_qkv.weight",
                     "blocks.0.attention.projection.bias", "blocks.1.norm_mlp.bias", "blocks.1.mlp.fc1.weight",
                     "blocks.1.mlp.fc2.weight"):
        assert expected in names
    assert a.blocks[0].attention.lin_qkv.weight.shape == (24, 8)
    assert a.blocks[0].mlp.fc1.weight.shape == (16, 8)


def test_constructor_errors():
    with pytest.raises(ValueError, match="num_channels=10 must be a positive multiple of num_heads=4"):
        SlidingWindowAttention(10, 4, 2)
    with pytest.raises(ValueError, match="window_size must be a non-negative int"):
        SlidingWindowAttention(8, 2, -1)
    with pytest.raises(ValueError, match="shard_strategy must be one of"):
        SlidingWindowAttention(8, 2, 1, "ring")
    with pytest.raises(ValueError, match="shard_strategy must be one of"):
        TransformerProcessor(1, 8, 2, 1, shard_strategy="pipeline")
    with pytest.raises(ValueError, match="num_layers must be at least 1"):
        TransformerProcessor(0, 8, 2, 1)
    with pytest.raises(ValueError, match="mlp_ratio"):
        MLP(8, 0)
    layer = SlidingWindowAttention(8, 2, 1)
    with pytest.raises(ValueError, match=r"x must be \(batch, seq_local, 8\)"):
        layer(torch.zeros(3, 8))
    layer = SlidingWindowAttention(8, 2, 1, shard=SequenceShard.unsharded(4))
    with pytest.raises(ValueError, match=r"input x has 3 rows along dim 1 .* gives this rank \(rank 0 of 1\) 4 "):
        layer(torch.zeros(1, 3, 8))
    with pytest.raises(TypeError, match="shard must be a SequenceShard or None"):
        SlidingWindowAttention(8, 2, 1, shard=[4])


def test_local_length_must_match_the_shard():
    """Every layer bound to a shard rejects an input whose local length is not its shard's, clearly."""
    shard = SequenceShard.unsharded(5)
    x = torch.zeros(2, 4, 8)
    layers = [SlidingWindowAttention(8, 2, 1, "shard_heads", shard), TransformerBlock(8, 2, 1, 2, shard=shard),
              build_transformer_processor(2, 8, 2, 1, shard=shard),
              build_transformer_processor(1, 8, 2, 1, shard_strategy="tensor", shard=shard,
                                          activation_checkpointing=True)]
    for layer in layers:
        with pytest.raises(ValueError, match=r"has 4 rows along dim 1 \(shape \(2, 4, 8\)\) but its SequenceShard "
                                              r"gives this rank \(rank 0 of 1\) 5 of sizes \[5\]"):
            layer(x)
    block = ConditionalTransformerBlock(8, 2, 1, 3, shard=shard)
    with pytest.raises(ValueError, match="has 4 rows along dim 1"):
        block(x, torch.zeros(2, 4, 3))
    torch.testing.assert_close(layers[0](torch.zeros(2, 5, 8)).shape, (2, 5, 8))


# ------------------------------------------------------------------------------------------
# sharded runs on ranks
# ------------------------------------------------------------------------------------------


def _sharded(module, x, grad, sizes, me):
    """This rank's output, input gradient and parameter gradients of ``module`` (built with the shard) on its slice."""
    off = balanced_offsets(sizes)[me]
    local = x[:, off : off + sizes[me]].clone().requires_grad_()
    module.zero_grad()
    out = module(local)
    out.backward(grad[:, off : off + sizes[me]])
    return out.detach(), local.grad, {n: p.grad.clone() for n, p in module.named_parameters()}


def _attention_case(case, shard=None):
    kind, n, channels, heads, window, strategy, extra, seed = case
    if kind == "layer":
        module = _make_attention(channels, heads, window, strategy, seed, shard)
    else:
        module = _make_processor(2, channels, heads, window, strategy, extra, seed, shard)
    return module, _rand((1 if n > 500 else 2, n, channels), seed + 1), _rand((1 if n > 500 else 2, n, channels), seed + 2)


def _run_cases(rank, world, cases):
    group = dist.group.WORLD
    results = []
    for case in cases:
        sizes = balanced_sizes(case[1], world)
        module, x, grad = _attention_case(case, SequenceShard(sizes, group))
        if case[6] == "selective":  # a first, watched step; the checked one keeps the kernels' outputs without a mode
            _sharded(module, x, grad, sizes, rank)
            assert all(m.keeps_own_outputs() for m in module.modules() if isinstance(m, ActivationCheckpoint))
        results.append(_sharded(module, x, grad, sizes, rank))
    return results


def _cases(world):
    cases, seed = [], 10
    small = 6 * world + world - 1  # uneven: e.g. 27 over 4 ranks = 7, 7, 7, 6
    sizes = balanced_sizes(small, world)
    # every window from 0 past the shard length for the halo path (what it sends depends on the
    # window), the edges for the all-to-all path; 2 * shard + 1 and the full length reach 2+ ranks
    edges = {0, 1, min(sizes) - 1, min(sizes), max(sizes), max(sizes) + 1, 2 * max(sizes) + 1, small}
    every = set(range(0, max(sizes) + 2)) | edges
    for strategy, windows in (("shard_sequence", every), ("shard_heads", edges)):
        for window in sorted(windows):
            cases.append(("layer", small, 24, 12, window, strategy, None, seed))
            seed += 3
    big = balanced_sizes(1001, world)  # 1001 over 3 ranks: 334, 334, 333
    for window, strategy in ((1, "shard_heads"), (min(big), "shard_sequence"), (max(big) + 100, "shard_sequence"),
                             (max(big), "shard_heads")):
        cases.append(("layer", 1001, 12, world, window, strategy, None, seed))
        seed += 3
    for strategy, checkpointing in (("shard_sequence", True), ("shard_heads", False), ("shard_sequence", "selective"),
                                    ("shard_heads", "selective")):
        cases.append(("processor", small, 24, 12, 3, strategy, checkpointing, seed))
        seed += 3
    # checkpointing with both strategies: heads + checkpointing on 2 ranks, sequence without on 4
    strategy = "shard_heads" if world == 2 else "shard_sequence"
    cases.append(("processor", 1001, 12, world, 40, strategy, world != 4, seed))
    return cases


def _reference(case, module, x, grad):
    single = _single(module, x, grad)
    dense = _dense_attention_layer if case[0] == "layer" else _dense_processor
    _assert_same(single, _single(module, x, grad, dense))
    return single


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_equals_single_and_dense(world):
    cases = _cases(world)
    per_rank = run_distributed(_run_cases, world, cases)
    for i, case in enumerate(cases):
        module, x, grad = _attention_case(case)
        ref = _reference(case, module, x, grad)
        outs = [per_rank[r][i] for r in range(world)]
        out = torch.cat([o[0] for o in outs], dim=1)
        x_grad = torch.cat([o[1] for o in outs], dim=1)
        params = {name: sum(o[2][name] for o in outs) for name in outs[0][2]}
        try:
            _assert_same((out, x_grad, params), ref)
        except AssertionError as err:
            raise AssertionError(f"case {case} on {world} ranks: {err}") from None


def _errors_on_ranks(rank, world):
    group = dist.group.WORLD
    sizes = balanced_sizes(10, world)
    x = torch.zeros(1, sizes[rank], 8)
    shard = SequenceShard(sizes, group)
    with pytest.raises(ValueError, match="needs num_heads=4 divisible by the group size 3"):
        SlidingWindowAttention(8, 4, 2, "shard_heads", shard)
    with pytest.raises(ValueError, match=r"SequenceShard.sizes lists 2 shards but the process group has 3 ranks"):
        SlidingWindowAttention(8, 4, 2, "shard_sequence", SequenceShard([5, 5], group))
    with pytest.raises(TypeError, match="shard must be a SequenceShard or None"):
        SlidingWindowAttention(8, 4, 2, "shard_sequence", sizes)
    layer = SlidingWindowAttention(8, 4, 2, "shard_sequence", SequenceShard([9, 9, 9], group))
    with pytest.raises(ValueError, match=rf"input x has {sizes[rank]} rows along dim 1 .* gives this rank "
                                          rf"\(rank {rank} of 3\) 9 of sizes \[9, 9, 9\]"):
        layer(x)
    # communication per layer: halos of x on shard_sequence, two all-to-alls on shard_heads
    counts = {}
    for strategy in ("shard_sequence", "shard_heads"):
        layer = SlidingWindowAttention(6, 3, 2, strategy, shard)
        with CommCounter() as counter:
            layer(torch.zeros(1, sizes[rank], 6))
        counts[strategy] = counter.as_dict()
    halo_rows = {0: 2, 1: 4, 2: 2}[rank]
    assert counts["shard_sequence"] == {"all_to_all": {"calls": 1, "bytes": halo_rows * 6 * 4}}
    assert counts["shard_heads"]["all_to_all"]["calls"] == 2
    return True


def test_errors_and_bytes_on_ranks():
    run_distributed(_errors_on_ranks, 3)


def test_split_qkv_views_and_one_gradient_copy():
    """:func:`split_qkv` copies nothing forward; given q, k, v gradients in the views' memory order (as flex
    and flash-attn write them), the backward to ``lin_qkv``'s output is one stack (its size written once),
    where indexing a ``three``-first rearrangement zero-fills three ``qkv``-sized gradients."""
    from tests.test_step_census import step_census

    heads, d, b, s = 3, 5, 2, 11
    for heads_first in (False, True):
        shape = (b, heads, s, 3 * d) if heads_first else (b, s, heads * 3 * d)
        qkv = torch.randn(shape, dtype=torch.float64, requires_grad=True)
        q, k, v = split_qkv(qkv, heads, heads_first=heads_first)
        grads = [torch.randn(b, s, heads, d, dtype=torch.float64).transpose(1, 2) for _ in range(3)]
        if heads_first:
            grads = [g.contiguous() for g in grads]
        result = step_census.census(lambda q=q, k=k, v=v, grads=grads: torch.autograd.backward((q, k, v), grads), [])
        assert sum(result.copy_bytes.values()) == qkv.numel() * 8, result.table()
        assert not {"zeros", "new_zeros", "fill_", "add"} & set(result.ops), result.table()
        expected = torch.stack(grads, dim=0)
        if heads_first:
            expected = einops.rearrange(expected, "three b h s d -> b h s (three d)")
        else:
            expected = einops.rearrange(expected, "three b h s d -> b s (h three d)")
        torch.testing.assert_close(qkv.grad, expected, rtol=0, atol=0)
