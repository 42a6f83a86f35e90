"""Sliding-window attention through ``torch.nn.attention.flex_attention`` with a block mask.

Same definition as :func:`stormshard.kernels.dispatch.sliding_window_attention`: query ``i`` at global
position ``q_offset + i`` attends key ``j`` at ``k_offset + j`` exactly when
``|pos_q - pos_k| <= window_size``; a query with no key in reach returns zeros. Layout: ``q``
``(batch, heads, Lq, dim)``, ``k`` and ``v`` ``(batch, heads, Lk, dim)``.

The mask is a block mask over ``(Lq, Lk)`` built from the band's tiles (:func:`band_blocks`: tiles
outside the band skipped, tiles inside it unmasked, only the band's edges evaluate the mask), so time grows linearly with the sequence, and the halo offsets of
``shard_sequence`` enter as a shift ``q_offset - k_offset``. The shift and the window are captured
as 0-dim tensors, so one compiled kernel serves every rank's offsets; block masks are cached per
``(Lq, Lk, shift, window, device)``. The kernel is ``torch.compile(flex_attention, dynamic=True)``,
compiled once per process (a first call costs seconds to tens of seconds; further shapes reuse it).
Triton tiles come from :data:`TUNED_KERNEL_OPTIONS` (measured per device, dtype and head dim) unless
:func:`set_flex_kernel_options` or ``STORMSHARD_FLEX_KERNEL_OPTIONS`` say otherwise.

On a CPU the keys are padded to a multiple of 16 with masked-out zeros (:func:`cpu_key_padding`: torch 2.13's
compiled CPU kernel is wrong for some short key lengths otherwise). torch 2.13's flex attention has a CPU forward but
no CPU backward: on a CPU this kernel serves
forecasts and forward checks, and asking for a gradient through it raises a ValueError before any
work. On CUDA it trains (Triton kernels, softmax statistics in fp32 for bf16 inputs).

Nothing is communicated here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from stormshard.env import env_json_object

__all__ = ["flex_attention_unavailable", "flex_problem", "flex_unusable", "flex_window_attention", "window_block_mask", "band_blocks",
           "flex_kernel_options", "set_flex_kernel_options", "flex_option_keys", "flex_options_from_env",
           "separate_cpu_buffers", "SHARED_BUFFER_CPU_TORCH", "cpu_key_padding", "CPU_KEY_MULTIPLE"]

_MASK_CACHE_SIZE = 64
_BLOCK = 128  # flex attention's default tile


_PROBE: list = []  # [reason or None] once probed (a list, not lru_cache: torch.compile only reads it)
_COMPILED: list = []  # [the compiled flex_attention]


def flex_attention_unavailable() -> str | None:
    """None when flex attention can run in this process, else why not (a sentence); decided once."""
    if not _PROBE:
        try:
            from torch.nn.attention import flex_attention as _flex  # noqa: F401
            _PROBE.append(None)
        except ImportError as err:  # torch < 2.5
            _PROBE.append(f"torch {torch.__version__} has no torch.nn.attention.flex_attention ({err}); it needs "
                          "torch >= 2.5")
    return _PROBE[0]


_PRECISION_OF = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


def flex_problem(device_type: str, *, precision: str | None, head_dim: int | None, backward: bool) -> str | None:
    """Why flex attention cannot run on ``device_type`` at ``precision`` (``"fp32"``, ``"bf16"``, ...; None:
    not known) with heads of ``head_dim`` (None: not known), with a backward or forward only; None when it can."""
    unavailable = flex_attention_unavailable()
    if unavailable is not None:
        return unavailable
    if device_type == "cuda" and head_dim is not None and head_dim < 16:
        return (f"flex attention on CUDA needs a head dim of at least 16 (Triton's dot), got num_channels / "
                f"num_heads = {head_dim}: use fewer heads")
    if device_type != "cuda" and backward:
        return (f"torch's flex attention has no backward on {device_type}: train there with 'auto' or 'banded' "
                "(a forecast can run flex: launch/forecast.py --attention-kernel flex)")
    if device_type == "cpu" and precision == "fp64":
        return "flex attention on a CPU computes in fp32, bf16 or fp16, not fp64: use fp32, or 'banded' for fp64"
    return None


def flex_unusable(q: Tensor, v: Tensor, backward: bool = False) -> str | None:
    """None when flex attention can compute ``q`` / ``v`` here (with a backward: ``backward``), else why
    not: :func:`flex_problem` on the tensors' device, dtype and head dim."""
    return flex_problem(q.device.type, precision=_PRECISION_OF.get(q.dtype), head_dim=min(q.shape[-1], v.shape[-1]),
                        backward=backward)


def _flex_attention() -> Callable[..., Tensor]:
    """flex_attention compiled once per process; inside a compiled graph the plain function (the
    enclosing torch.compile compiles it)."""
    from torch.nn.attention.flex_attention import flex_attention

    if torch.compiler.is_compiling():
        return flex_attention
    if not _COMPILED:
        _COMPILED.append(torch.compile(flex_attention, dynamic=True))
    return _COMPILED[0]


_block_masks: OrderedDict[tuple, tuple[object, Tensor, Tensor]] = OrderedDict()  # key -> (mask, shift, window)

# Triton tile options for flex attention, keyed by (CUDA compute capability, dtype, head dim):
# measured by ``benchmarks/bench_gpu.py`` (its flex-options table); absent keys keep torch's defaults.
# Measured on one H100 (sm90, torch 2.11, bf16, head dim 64, the AIFS attention shape): forward
# 1.63 -> 1.40 ms, backward 4.09 -> 3.51 ms against torch's default tiles
# (benchmarks/results/bench_gpu_h100_run3.log).
TUNED_KERNEL_OPTIONS: dict[tuple[tuple[int, int], torch.dtype, int], dict] = {
    ((9, 0), torch.bfloat16, 64): {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3,
                                   "bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                                   "bwd_num_warps": 4, "bwd_num_stages": 3},
}
_CAPABILITIES: list = []  # [((major, minor) per visible CUDA device)] once read (compiled code only reads it)
_USER_OPTIONS: list = []  # [dict] once set by set_flex_kernel_options or STORMSHARD_FLEX_KERNEL_OPTIONS


def set_flex_kernel_options(options: dict | None) -> None:
    """Use ``options`` (flex attention's ``kernel_options``: ``BLOCK_M``, ``BLOCK_N``, ``num_warps``,
    ``num_stages``, ``fwd_*`` / ``bwd_*`` variants, ``USE_TMA``, ...) for every later flex call in this
    process instead of the tuned table; None goes back to the table. The environment variable
    ``STORMSHARD_FLEX_KERNEL_OPTIONS`` (a JSON object) sets the same at start-up."""
    if options is not None and not isinstance(options, dict):
        raise TypeError(f"flex kernel options must be a dict or None, got {type(options).__name__}")
    _USER_OPTIONS.clear()
    _USER_OPTIONS.append(None if options is None else dict(options))


def flex_option_keys() -> frozenset[str]:
    """The ``kernel_options`` keys flex attention takes: the installed torch's ``FlexKernelOptions``
    (``BLOCK_M``, ``num_warps``, ``USE_TMA``, ...) and their ``fwd_`` / ``bwd_`` variants."""
    try:
        from torch.nn.attention.flex_attention import FlexKernelOptions

        base = set(FlexKernelOptions.__annotations__)
    except ImportError:  # torch < 2.5: flex attention itself is unavailable (flex_attention_unavailable says so)
        base = {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
    return frozenset(base | {f"{p}_{k}" for p in ("fwd", "bwd") for k in base})


def flex_options_from_env(env: Mapping[str, str] | None = None) -> dict | None:
    """``STORMSHARD_FLEX_KERNEL_OPTIONS``: a JSON object of :func:`flex_option_keys` (None when unset);
    anything else (not JSON, not an object, an unknown key) is an :class:`~stormshard.env.EnvError`
    naming the variable (the training preflight reads it before any work)."""
    keys = flex_option_keys()
    return env_json_object("STORMSHARD_FLEX_KERNEL_OPTIONS", example='{"BLOCK_M": 128, "BLOCK_N": 64}',
                           allowed=keys, known=keys, env=env)


def _user_options() -> dict | None:
    if not _USER_OPTIONS:
        _USER_OPTIONS.append(flex_options_from_env())
    return _USER_OPTIONS[0]


def flex_kernel_options_ready() -> None:
    """Read ``STORMSHARD_FLEX_KERNEL_OPTIONS`` and the CUDA devices' compute capabilities now (outside
    any compiled region; compiled code only reads them)."""
    _user_options()
    if torch.cuda.is_available():
        _capability(0)


def _capability(index: int) -> tuple[int, int]:
    if not _CAPABILITIES:
        _CAPABILITIES.append(tuple(torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())))
    return _CAPABILITIES[0][index]


def flex_kernel_options(q: Tensor) -> dict | None:
    """The ``kernel_options`` flex attention runs ``q`` with: the user's (:func:`set_flex_kernel_options`),
    else the measured table's entry for q's device, dtype and head dim, else None (torch's defaults)."""
    user = _user_options()
    if user is not None:
        return user
    if q.device.type != "cuda" or not TUNED_KERNEL_OPTIONS:
        return None
    key = (_capability(q.device.index or 0), q.dtype, q.shape[-1])
    return TUNED_KERNEL_OPTIONS.get(key)


def window_block_mask(num_q: int, num_k: int, shift: int, window_size: int, device: torch.device,
                      key_padding: int = 0) -> object:
    """The band ``|i + shift - j| <= window_size`` over ``(num_q, num_k)`` as a flex ``BlockMask``.

    ``key_padding`` keys past ``num_k`` (zeros appended by :func:`flex_window_attention`, see
    :func:`cpu_key_padding`) are in the mask's shape ``(num_q, num_k + key_padding)`` but never attended.
    Cached (least recently used, 64 entries) per ``(num_q, num_k, shift, window_size, device, key_padding)``.
    Inside compiled code the mask's tensors come from the custom op ``stormshard::window_block_tensors``,
    built eagerly and cached the same way: nothing of the mask is traced (no side effect inside a
    compiled, checkpointed block; no index arithmetic for Inductor to lower).
    """
    from torch.nn.attention.flex_attention import BlockMask

    if torch.compiler.is_compiling():
        *blocks, shift_t, window_t = torch.ops.stormshard.window_block_tensors(num_q, num_k, shift, window_size,
                                                                               device, key_padding)
        return BlockMask((num_q, num_k + key_padding), *blocks, BLOCK_SIZE=(_BLOCK, _BLOCK),
                         mask_mod=_band_mask_mod(shift_t, window_t, num_k if key_padding else None))
    return _cached_block_mask(num_q, num_k, shift, window_size, device, key_padding)[0]


def _band_mask_mod(shift_t: Tensor, window_t: Tensor, key_limit: int | None) -> Callable[..., Tensor]:
    """flex's ``mask_mod`` of the band; with ``key_limit`` also ``k_idx < key_limit`` (padded keys out)."""
    if key_limit is None:
        def in_window(batch: Tensor, head: Tensor, q_idx: Tensor, k_idx: Tensor) -> Tensor:
            return (q_idx + shift_t - k_idx).abs() <= window_t
    else:
        def in_window(batch: Tensor, head: Tensor, q_idx: Tensor, k_idx: Tensor) -> Tensor:
            return ((q_idx + shift_t - k_idx).abs() <= window_t) & (k_idx < key_limit)
    return in_window


def _cached_block_mask(num_q: int, num_k: int, shift: int, window_size: int, device: torch.device,
                       key_padding: int = 0) -> tuple[object, Tensor, Tensor]:
    """``(BlockMask, shift tensor, window tensor)`` from the cache, built eagerly when missing."""
    from torch.nn.attention.flex_attention import BlockMask

    key = (num_q, num_k, shift, window_size, str(device), key_padding)
    entry = _block_masks.get(key)
    if entry is not None:
        _block_masks.move_to_end(key)
        return entry
    shift_t = torch.tensor(shift, device=device)
    window_t = torch.tensor(window_size, device=device)
    in_window = _band_mask_mod(shift_t, window_t, num_k if key_padding else None)

    # the tiles of the real keys: padding stays within the last key block (cpu_key_padding), whose tiles are then
    # ragged and so partial (the mask, with its key limit, is evaluated there)
    partial, full = band_blocks(num_q, num_k, shift, window_size, _BLOCK)
    # per query block its key tiles, and per key block its query tiles (the transpose), partial and full
    # (built directly: BlockMask.from_kv_blocks' vmap fails inside a custom op called from compiled code)
    lists = [t.to(device) for tiles in (partial, full, partial.T, full.T) for t in _kv_block_lists(tiles)]
    kv, full_kv, q, full_q = lists[0:2], lists[2:4], lists[4:6], lists[6:8]
    mask = BlockMask((num_q, num_k + key_padding), *kv, *full_kv, *q, *full_q, BLOCK_SIZE=(_BLOCK, _BLOCK),
                     mask_mod=in_window)
    entry = (mask, shift_t, window_t)
    _block_masks[key] = entry
    if len(_block_masks) > _MASK_CACHE_SIZE:
        _block_masks.popitem(last=False)
    return entry


@torch.library.custom_op("stormshard::window_block_tensors", mutates_args=())
def _window_block_tensors(num_q: int, num_k: int, shift: int, window_size: int, device: torch.device,
                          key_padding: int) -> list[Tensor]:
    """The band mask's tensors for compiled code: kv_num_blocks, kv_indices, full_kv_num_blocks,
    full_kv_indices, q_num_blocks, q_indices, full_q_num_blocks, full_q_indices (int32, ``(1, 1, ...)``),
    then the 0-dim shift and window. Copies of the cached mask's (outputs are the caller's to reuse)."""
    mask, shift_t, window_t = _cached_block_mask(num_q, num_k, shift, window_size, device, key_padding)
    blocks = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
              mask.q_num_blocks, mask.q_indices, mask.full_q_num_blocks, mask.full_q_indices)
    return [t.clone() for t in (*blocks, shift_t, window_t)]


@_window_block_tensors.register_fake
def _(num_q: int, num_k: int, shift: int, window_size: int, device: torch.device, key_padding: int) -> list[Tensor]:
    q_blocks, k_blocks = -(-num_q // _BLOCK), -(-num_k // _BLOCK)
    shapes = [(1, 1, q_blocks), (1, 1, q_blocks, k_blocks)] * 2 + [(1, 1, k_blocks), (1, 1, k_blocks, q_blocks)] * 2
    blocks = [torch.empty(shape, dtype=torch.int32, device=device) for shape in shapes]
    return blocks + [torch.empty((), dtype=torch.int64, device=device) for _ in range(2)]


def band_blocks(num_q: int, num_k: int, shift: int, window_size: int, block: int) -> tuple[Tensor, Tensor]:
    """``(partial, full)`` boolean ``(q_blocks, k_blocks)`` maps of the band's ``block x block`` tiles.

    A tile is *full* when every query of it reaches every key of it (and both blocks are whole, not
    the sequences' ragged ends): flex skips the mask there. *Partial* tiles hold some reachable
    pairs; the mask is evaluated on them. Computed from the block bounds, never from an
    ``(Lq, Lk)`` mask (40,320^2 entries at the AIFS shape).
    """
    q_start = torch.arange(0, num_q, block)
    k_start = torch.arange(0, num_k, block)
    q_last = torch.clamp(q_start + block, max=num_q) - 1
    k_last = torch.clamp(k_start + block, max=num_k) - 1
    # query i reaches keys [i + shift - w, i + shift + w]: a tile has a pair in reach when its key
    # interval meets the union of its queries' intervals
    some = (k_start[None, :] <= q_last[:, None] + shift + window_size) & \
        (k_last[None, :] >= q_start[:, None] + shift - window_size)
    every = (q_last[:, None] + shift - k_start[None, :] <= window_size) & \
        (k_last[None, :] - q_start[:, None] - shift <= window_size)
    whole = ((q_last - q_start + 1) == block)[:, None] & ((k_last - k_start + 1) == block)[None, :]
    full = some & every & whole
    return some & ~full, full


def _kv_block_lists(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """flex's ``(kv_num_blocks (1, 1, q_blocks), kv_indices (1, 1, q_blocks, k_blocks))`` of a tile map:
    per query block the count of its tiles and their key-block indices first, in order."""
    counts = tiles.sum(dim=-1, dtype=torch.int32)
    order = torch.argsort((~tiles).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[None, None].contiguous(), order[None, None].contiguous()


#: the first torch whose CPU flex lowering takes q, k and v as views of one buffer (torch 2.11's refuses them in
#: a compiled block: "Unsupported for now if query, key, value are the same buffer"; CUDA's takes them in both)
SHARED_BUFFER_CPU_TORCH = "2.13"


def separate_cpu_buffers(device_type: str, version: str | None = None) -> bool:
    """Whether flex on ``device_type`` under torch ``version`` (None: the one installed) needs q, k and v in
    buffers of their own: on a CPU before :data:`SHARED_BUFFER_CPU_TORCH` (forward only there: forecasts, where
    the copies cost little)."""
    from torch.torch_version import TorchVersion

    return device_type == "cpu" and TorchVersion(version or torch.__version__) < SHARED_BUFFER_CPU_TORCH


_CPU_SEPARATE_BUFFERS = separate_cpu_buffers("cpu")  # once, outside any compiled region

#: keys on a CPU are padded to a multiple of this (see :func:`cpu_key_padding`)
CPU_KEY_MULTIPLE = 16


def cpu_key_padding(device_type: str, num_k: int) -> int:
    """How many masked-out zero keys :func:`flex_window_attention` appends on ``device_type`` to ``num_k`` keys.

    torch 2.13's compiled CPU flex attention (Inductor's C++ template) returns wrong rows or NaN for head dims
    of 8 and 16 when fewer than 128 keys number 8 mod 16 (24, 40, ..., 120: measured on an AVX2 host; eager flex
    and CUDA are exact). On a CPU the keys are padded to a multiple of :data:`CPU_KEY_MULTIPLE` (at most 15 zero
    keys, none attended: the mask stops at ``num_k``), which avoids it; nothing on CUDA.
    """
    return -num_k % CPU_KEY_MULTIPLE if device_type == "cpu" else 0


def flex_window_attention(q: Tensor, k: Tensor, v: Tensor, window_size: int, q_offset: int = 0,
                          k_offset: int = 0, *, scale: float) -> Tensor:
    """``softmax(q k^T * scale + band) v`` by flex attention; ``(batch, heads, Lq, dim)`` out, q's dtype.

    Inputs are checked by the caller (:func:`stormshard.kernels.dispatch.sliding_window_attention`).
    Raises ValueError when a gradient is asked for on a CPU (torch has no CPU backward for it).
    """
    backward = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    reason = flex_unusable(q, v, backward)
    if reason is not None:
        raise ValueError(f"attention_kernel 'flex' cannot run: {reason}; use attention_kernel 'banded' or 'auto'"
                         + (", or run this forward under torch.no_grad() (forecasts)" if backward else ""))
    dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    q, k, v = (t.to(dtype) for t in (q, k, v))
    shift = int(q_offset) - int(k_offset)
    num_k = k.shape[-2]
    key_padding = cpu_key_padding(q.device.type, num_k)
    if key_padding:
        if torch.compiler.is_compiling():  # Inductor's CPU lowering then reads q's base as 4-d: a buffer of its own
            q = q.contiguous()
        k, v = (torch.nn.functional.pad(t, (0, 0, 0, key_padding)) for t in (k, v))
    mask = window_block_mask(q.shape[-2], num_k, shift, window_size, q.device, key_padding)
    # q, k, v as they are (views of one projection, :func:`~stormshard.layers.attention.split_qkv`): flex reads
    # any strides, and writes its output and gradients in their memory order
    if _CPU_SEPARATE_BUFFERS and q.device.type == "cpu":
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    return _flex_attention()(q, k, v, block_mask=mask, scale=scale, kernel_options=flex_kernel_options(q))
