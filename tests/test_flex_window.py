"""The flex-attention sliding-window kernel (``attention_kernel="flex"``) against the banded kernel.

On a CPU torch's flex attention has a forward only, so these tests compare forwards (under
``torch.no_grad``, as a forecast runs): the kernel with halo offsets and rows without keys, and the
sharded layer and processor (``shard_sequence``, ``shard_heads``, ``tensor``) at 2-4 ranks with
uneven shards against the single-process banded run, in float32 within round-off. Gradients are
compared on CUDA (``tests/gpu/test_cuda_flex.py``). The compiled flex kernel is shared by the whole
process (and inductor's on-disk cache by the ranks), so the compile is paid about once.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from stormshard.kernels.dispatch import sliding_window_attention
from stormshard.kernels.flex import cpu_key_padding, separate_cpu_buffers
from stormshard.kernels.reference import dense_window_attention
from stormshard.layers import set_attention_kernel
from stormshard.layers.attention import SlidingWindowAttention
from stormshard.models.parallelize import build_transformer_processor
from stormshard.parallel.shapes import balanced_offsets, balanced_sizes
from stormshard.parallel.shard import SequenceShard
from tests.distributed import run_distributed

F32 = torch.float32
CLOSE = {"rtol": 2e-5, "atol": 2e-6}


def _rand(shape, seed, dtype=F32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


def test_flex_kernel_matches_banded_and_dense_with_offsets():
    cases = itertools.product([(7, 40), (130, 150), (333, 380)], [0, 3, 64], [0, 11, -20])
    for (lq, lk), window, shift in cases:
        q, k, v = (_rand((2, 3, n, 16), seed) for n, seed in ((lq, 1), (lk, 2), (lk, 3)))
        with torch.no_grad():
            flex = sliding_window_attention(q, k, v, window, q_offset=shift, kernel="flex")
            banded = sliding_window_attention(q, k, v, window, q_offset=shift, kernel="banded")
        torch.testing.assert_close(flex, banded, **CLOSE, msg=f"lq={lq} lk={lk} w={window} shift={shift}")
        torch.testing.assert_close(flex, dense_window_attention(q, k, v, window, q_offset=shift), **CLOSE)


def test_flex_pads_cpu_keys_past_inductors_small_key_bug():
    """torch 2.13's compiled CPU flex is wrong for head dims 8 / 16 with 24, 40, ..., 120 keys (8 mod 16): the
    kernel pads the keys to a multiple of 16, masked out, and matches the banded kernel there."""
    assert [cpu_key_padding("cpu", n) for n in (1, 16, 24, 40, 129)] == [15, 0, 8, 8, 15]
    assert cpu_key_padding("cuda", 40) == 0
    for dim, lk in itertools.product([8, 16], [24, 40, 88, 120]):
        q, k, v = _rand((1, 2, 8, dim), 8), _rand((1, 2, lk, dim), 9), _rand((1, 2, lk, dim), 10)
        with torch.no_grad():
            flex = sliding_window_attention(q, k, v, 3, q_offset=lk - 8, kernel="flex")
        torch.testing.assert_close(flex, dense_window_attention(q, k, v, 3, q_offset=lk - 8), **CLOSE,
                                   msg=f"dim={dim} lk={lk}")


def test_flex_rows_without_keys_are_zero():
    q, k, v = _rand((1, 2, 50, 16), 4), _rand((1, 2, 20, 16), 5), _rand((1, 2, 20, 16), 6)
    with torch.no_grad():
        out = sliding_window_attention(q, k, v, 2, q_offset=30, kernel="flex")  # queries 0..7 reach no key
    assert torch.isfinite(out).all()
    assert out[:, :, 30 + 2 + 1 - 30 + 20:].abs().max() == 0  # queries at 23.. see keys up to 21 only
    torch.testing.assert_close(out, sliding_window_attention(q, k, v, 2, q_offset=30, kernel="banded"), **CLOSE)


def test_flex_backward_on_cpu_is_a_clear_error():
    q = _rand((1, 2, 20, 16), 7).requires_grad_()
    with pytest.raises(ValueError, match=r"attention_kernel 'flex' cannot run: torch's flex attention has no backward on cpu.*'banded'"):
        sliding_window_attention(q, q, q, 3, kernel="flex")


def test_kernel_names_and_cpu_choices():
    q = _rand((1, 2, 20, 16), 8)
    with pytest.raises(ValueError, match=r"attention_kernel must be one of 'auto', 'banded', 'flex', 'flash', got 'fast'"):
        sliding_window_attention(q, q, q, 3, kernel="fast")
    with pytest.raises(ValueError, match=r"attention_kernel 'flash' cannot run: flash-attn runs on CUDA only"):
        sliding_window_attention(q, q, q, 3, kernel="flash")
    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        SlidingWindowAttention(8, 2, 3, attention_kernel="triton")
    # auto on a CPU is the banded kernel, for training and forecasts: bit for bit
    auto = sliding_window_attention(q, q, q, 3)
    assert torch.equal(auto, sliding_window_attention(q, q, q, 3, kernel="banded"))


def test_set_attention_kernel_switches_every_layer():
    torch.manual_seed(0)
    proc = build_transformer_processor(3, 16, 4, 5)
    x = _rand((2, 40, 16), 9)
    with torch.no_grad():
        banded = proc(x)
        assert set_attention_kernel(proc, "flex") == 3
        assert {b.attention.attention_kernel for b in proc.blocks} == {"flex"}
        torch.testing.assert_close(proc(x), banded, **CLOSE)
    with pytest.raises(ValueError, match="attention_kernel must be one of"):
        set_attention_kernel(proc, "fast")


def _build(kind, strategy, n, heads, window, seed, shard):
    torch.manual_seed(seed)
    if kind == "layer":
        return SlidingWindowAttention(24, heads, window, strategy, shard)
    return build_transformer_processor(2, 24, heads, window, shard_strategy=strategy, shard=shard)


def _cases(world):
    small = 6 * world + world - 1  # uneven: 27 over 4 ranks = 7, 7, 7, 6
    cases = []
    for strategy in ("shard_sequence", "shard_heads"):
        for window in (1, max(balanced_sizes(small, world)) + 1):
            cases.append(("layer", strategy, small, 12, window))
    cases.append(("layer", "shard_sequence", 1001, 12, 40))  # 1001 over 3 ranks: 334, 334, 333
    for strategy in ("shard_sequence", "shard_heads", "tensor"):
        cases.append(("processor", strategy, 1001 if strategy == "shard_sequence" else small, 12, 5))
    return cases


def _flex_forward_on_ranks(rank, world, cases):
    outs = []
    for i, (kind, strategy, n, heads, window) in enumerate(cases):
        sizes = balanced_sizes(n, world)
        module = _build(kind, strategy, n, heads, window, 100 + i, SequenceShard(sizes, dist.group.WORLD))
        set_attention_kernel(module, "flex")
        off = balanced_offsets(sizes)[rank]
        x = _rand((2, n, 24), 200 + i)[:, off : off + sizes[rank]]
        with torch.no_grad():
            outs.append(module(x))
    return outs


@pytest.mark.parametrize("world", [2, 3, 4])
def test_sharded_flex_forward_equals_single_process_banded(world):
    cases = _cases(world)
    per_rank = run_distributed(_flex_forward_on_ranks, world, cases, timeout=600)  # a cold inductor compile per rank
    for i, (kind, strategy, n, heads, window) in enumerate(cases):
        module = _build(kind, strategy, n, heads, window, 100 + i, None)
        with torch.no_grad():
            ref = module(_rand((2, n, 24), 200 + i))
        out = torch.cat([per_rank[r][i] for r in range(world)], dim=1)
        torch.testing.assert_close(out, ref, **CLOSE, msg=f"world {world}: {kind} {strategy} n={n} window={window}")


def test_band_blocks_match_the_elementwise_mask():
    from stormshard.kernels.flex import band_blocks

    for num_q, num_k, shift, window, block in [(300, 300, 0, 40, 16), (333, 380, 10, 32, 32), (50, 20, 30, 2, 8),
                                               (129, 257, -20, 0, 16), (1001, 1001, 0, 1000, 128)]:
        partial, full = band_blocks(num_q, num_k, shift, window, block)
        allowed = ((torch.arange(num_q)[:, None] + shift - torch.arange(num_k)[None, :]).abs() <= window)
        for i in range(partial.shape[0]):
            for j in range(partial.shape[1]):
                tile = allowed[i * block:(i + 1) * block, j * block:(j + 1) * block]
                whole = tile.shape == (block, block)
                assert bool(full[i, j]) == bool(whole and tile.all()), (num_q, num_k, shift, window, i, j)
                assert bool(partial[i, j] or full[i, j]) == bool(tile.any()), (num_q, num_k, shift, window, i, j)


def test_compiled_flex_processor_forward_equals_eager_banded():
    """compile_blocks (inductor) around flex blocks: the mask comes from the custom op, nothing of it is
    traced; the forward of every block compiles without a graph break and equals the eager banded run."""
    from stormshard.models.compile import compile_blocks

    torch.manual_seed(0)
    banded = build_transformer_processor(2, 32, 2, 9, attention_kernel="banded")
    flex = build_transformer_processor(2, 32, 2, 9, attention_kernel="flex")
    flex.load_state_dict(banded.state_dict())
    compile_blocks(flex, backend="inductor")
    x = _rand((1, 200, 32), 7)
    with torch.no_grad():
        torch.testing.assert_close(flex(x), banded(x), **CLOSE)
        torch.testing.assert_close(flex(x[:, :131]), banded(x[:, :131]), **CLOSE)  # another length: a recompile


def test_flex_kernel_options_setting_and_bad_values(monkeypatch):
    """The tile options: the table on CUDA only, a user's dict wins, a bad env value names the variable."""
    from stormshard.kernels import flex as flex_window

    q = _rand((1, 2, 64, 16), 1)
    monkeypatch.setattr(flex_window, "_USER_OPTIONS", [])
    monkeypatch.setenv("STORMSHARD_FLEX_KERNEL_OPTIONS", "")
    assert flex_window.flex_kernel_options(q) is None  # a CPU tensor: torch's defaults
    flex_window.set_flex_kernel_options({"BLOCK_M": 64})
    assert flex_window.flex_kernel_options(q) == {"BLOCK_M": 64}
    with pytest.raises(TypeError, match="dict or None"):
        flex_window.set_flex_kernel_options("BLOCK_M=64")
    for bad, match in (("{BLOCK_M: 64", "is not a JSON object"), ("[1, 2]", "must be a JSON object")):
        monkeypatch.setattr(flex_window, "_USER_OPTIONS", [])
        monkeypatch.setenv("STORMSHARD_FLEX_KERNEL_OPTIONS", bad)
        with pytest.raises(ValueError, match=f"STORMSHARD_FLEX_KERNEL_OPTIONS.*{match}"):
            flex_window.flex_kernel_options(q)
    monkeypatch.setattr(flex_window, "_USER_OPTIONS", [])
    monkeypatch.setenv("STORMSHARD_FLEX_KERNEL_OPTIONS", "{}")
    assert flex_window.flex_kernel_options(q) == {}
    k, v = _rand((1, 2, 64, 16), 2), _rand((1, 2, 64, 16), 3)  # three buffers: torch 2.11's CPU flex takes no other
    with torch.no_grad():  # {} reaches flex attention as torch's defaults
        out = sliding_window_attention(q, k, v, 5, kernel="flex")
    torch.testing.assert_close(out, sliding_window_attention(q, k, v, 5, kernel="banded"), **CLOSE)
    monkeypatch.setattr(flex_window, "_USER_OPTIONS", [])


def test_flex_reads_the_projection_views_and_writes_its_layout():
    """q, k, v are views of ``lin_qkv``'s output (:func:`split_qkv`, nothing copied); flex reads them as they
    are and writes its output in their ``(batch, seq, heads, d)`` memory order, so the output projection's
    input is a view of it: no copy before or after the kernel (on the GPU its gradients follow the same order,
    ``tests/test_step_census.py`` counts the step's copies)."""
    import einops

    from stormshard.layers.attention import split_qkv

    heads, d = 4, 8
    qkv = _rand((2, 37, heads * 3 * d), 11)
    q, k, v = split_qkv(qkv, heads)
    assert all(t.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr() for t in (q, k, v))
    reference = einops.rearrange(qkv, "b s (h three d) -> three b h s d", h=heads, three=3)
    for view, expected in zip((q, k, v), reference, strict=True):
        torch.testing.assert_close(view, expected, rtol=0, atol=0)
    with torch.no_grad():
        out = sliding_window_attention(q, k, v, 5, kernel="flex")
        banded = sliding_window_attention(q.contiguous(), k.contiguous(), v.contiguous(), 5, kernel="banded")
    torch.testing.assert_close(out, banded, **CLOSE)
    merged = einops.rearrange(out, "b h s d -> b s (h d)")
    if not separate_cpu_buffers("cpu"):  # torch 2.11's CPU flex takes contiguous copies (CUDA's: the views)
        assert merged.untyped_storage().data_ptr() == out.untyped_storage().data_ptr()  # a view, not a copy


def test_flex_separate_buffers_only_on_a_cpu_before_torch_2_13():
    assert separate_cpu_buffers("cpu", "2.11.0+cpu") and separate_cpu_buffers("cpu", "2.12.1")
    assert not separate_cpu_buffers("cpu", "2.13.0") and not separate_cpu_buffers("cpu", "2.14.0.dev20261101")
    assert not separate_cpu_buffers("cuda", "2.11.0+cu130")
