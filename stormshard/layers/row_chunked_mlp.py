"""An MLP ``fc2(GELU(fc1(x)))`` whose activation memory stays near one input's size on very many rows.

A decoder block at the AIFS size runs its MLP on 543,088 data nodes with a hidden width of 4,096: each hidden
activation is 4.1 GiB in bf16. Plain autograd keeps two of them for the backward (the pre-activation ``h`` for
GELU's gradient and GELU's output for ``fc2``'s weight gradient) and makes two more in the backward (the
gradient of GELU's output and of ``h``): three alive at once, 12.4 GiB, the peak of the whole eager training
step (``benchmarks/memory_simulation.py``). :class:`RowChunkedMLP` keeps ``h`` only and walks the rows in chunks:

- forward: ``h = fc1(x)`` in one product, then per row chunk ``y_c = fc2(GELU(h_c))`` (GELU's output exists one
  chunk at a time);
- backward, per row chunk: ``g_c = GELU(h_c)`` again, ``dW2 += dy_c^T g_c``, ``dg_c = dy_c W2``, ``dh_c =
  GELU'(h_c) dg_c``, ``dW1 += dh_c^T x_c``, ``dx_c = dh_c W1``: the same products as autograd's backward (no
  product is recomputed: GELU is), chunk-sized temporaries, weight and bias gradients summed in fp32.

So the MLP holds ``h`` plus a few chunks where autograd holds three full hidden activations at its peak, and
two from the forward to the backward (8 GiB less at the AIFS decoder's peak). Under autocast the products run in the autocast dtype as ``nn.Linear``'s would, and the gradients come
back in the parameters' dtype. The rows' forward values are those of the plain MLP (the same products on the same
rows; a chunk's rows are a contiguous slice of the same GEMM's operands); gradients differ from the plain MLP's
by the order of the sums over row chunks (float64: below 1e-12 relative).

It runs only where it pays: :class:`RowChunkedMLP` takes the plain path (bit for bit the ``nn.Sequential``) when
its hidden activation has fewer than ``min_elements`` entries (``2**27``, 256 MiB in bf16: never at the CPU
quickstart's sizes nor at O96, always at an N320 / O364 decoder) and without gradients. The forward and the
backward are custom ops (``stormshard::row_chunked_mlp``, ``..._backward``), so a compiled block keeps what they
keep: traced as plain operators, inductor's partitioner would save every chunk's GELU output again.
Layout: ``x`` ``(rows, *batch, C)``, any leading shape; nothing is communicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["RowChunkedMLP", "row_chunked_mlp", "MIN_ELEMENTS", "CHUNK_ELEMENTS"]

#: hidden activations with fewer entries run the plain MLP
MIN_ELEMENTS = 2 ** 27
#: entries of one chunk's hidden activation (128 MiB in bf16; at least one row)
CHUNK_ELEMENTS = 2 ** 26


def _compute_dtype(x: Tensor) -> torch.dtype:
    """The dtype ``nn.Linear`` computes ``x`` in: autocast's where it is on, else ``x``'s."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


# The forward and backward are custom ops: inside torch.compile, inductor calls them as they are and keeps what
# they keep (traced as plain operators, its partitioner would save every chunk's GELU output).


@torch.library.custom_op("stormshard::row_chunked_mlp", mutates_args=())
def _mlp_op(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
            rows: int) -> tuple[Tensor, Tensor]:
    """``(y (R, C_out), h (R, hidden))`` for ``x`` ``(R, C)``, every operand in one dtype."""
    with torch.autocast(x.device.type, enabled=False):
        h = F.linear(x, w1, b1)
        y = h.new_empty(h.shape[0], w2.shape[0])
        for first in range(0, h.shape[0], rows):
            end = min(first + rows, h.shape[0])
            y[first:end] = F.linear(F.gelu(h[first:end]), w2, b2)
    return y, h


@_mlp_op.register_fake
def _mlp_fake(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None,
              rows: int) -> tuple[Tensor, Tensor]:
    return x.new_empty(x.shape[0], w2.shape[0]), x.new_empty(x.shape[0], w1.shape[0])


@torch.library.custom_op("stormshard::row_chunked_mlp_backward", mutates_args=())
def _mlp_backward_op(dy: Tensor, x: Tensor, w1: Tensor, w2: Tensor, h: Tensor, rows: int,
                     needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``(x, w1, b1, w2, b2)`` (empty where ``needs`` is False), per row chunk; weight and bias
    gradients summed in fp32 (or float64) and returned in the weights' dtype."""
    need_x, need_w1, need_b1, need_w2, need_b2 = needs
    acc = torch.promote_types(h.dtype, torch.float32)
    dx = torch.empty_like(x) if need_x else x.new_empty(0)
    dw1, dw2 = (torch.zeros(w.shape, dtype=acc, device=w.device) if need else w.new_empty(0)
                for w, need in ((w1, need_w1), (w2, need_w2)))
    db1, db2 = (torch.zeros(w.shape[0], dtype=acc, device=w.device) if need else w.new_empty(0)
                for w, need in ((w1, need_b1), (w2, need_b2)))
    with torch.autocast(h.device.type, enabled=False):
        dy = dy.to(h.dtype)
        for first in range(0, h.shape[0], rows):
            end = min(first + rows, h.shape[0])
            h_c, dy_c = h[first:end], dy[first:end]
            if need_w2:
                dw2 += torch.mm(dy_c.t(), F.gelu(h_c)).to(acc)
            if need_b2:
                db2 += dy_c.sum(0, dtype=acc)
            dh_c = torch.ops.aten.gelu_backward(torch.mm(dy_c, w2), h_c)
            if need_w1:
                dw1 += torch.mm(dh_c.t(), x[first:end]).to(acc)
            if need_b1:
                db1 += dh_c.sum(0, dtype=acc)
            if need_x:
                dx[first:end] = torch.mm(dh_c, w1)
    return dx, dw1.to(w1.dtype), db1.to(w1.dtype), dw2.to(w2.dtype), db2.to(w2.dtype)


@_mlp_backward_op.register_fake
def _mlp_backward_fake(dy: Tensor, x: Tensor, w1: Tensor, w2: Tensor, h: Tensor, rows: int,
                       needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    shapes = (x.shape, w1.shape, w1.shape[:1], w2.shape, w2.shape[:1])
    likes = (x, w1, w1, w2, w2)
    return tuple(t.new_empty(shape) if need else t.new_empty(0) for t, shape, need in zip(likes, shapes, needs,
                                                                                          strict=True))


def _setup(ctx, inputs: tuple, output: tuple) -> None:  # noqa: ANN001
    x, w1, b1, w2, b2, rows = inputs
    ctx.save_for_backward(x, w1, w2, output[1])
    ctx.rows, ctx.has_bias = rows, (b1 is not None, b2 is not None)
    ctx.set_materialize_grads(False)  # no (rows, hidden) zeros for h's gradient, which nothing produces


def _op_backward(ctx, dy: Tensor | None, _dh: Tensor | None) -> tuple:  # noqa: ANN001
    x, w1, w2, h = ctx.saved_tensors
    if dy is None:
        return None, None, None, None, None, None
    n = ctx.needs_input_grad
    needs = [bool(n[0]), bool(n[1]), bool(n[2]) and ctx.has_bias[0], bool(n[3]), bool(n[4]) and ctx.has_bias[1]]
    grads = torch.ops.stormshard.row_chunked_mlp_backward(dy, x, w1, w2, h, ctx.rows, needs)
    return (*(g if need else None for g, need in zip(grads, needs, strict=True)), None)


_mlp_op.register_autograd(_op_backward, setup_context=_setup)


def row_chunked_mlp(x: Tensor, fc1: nn.Linear, fc2: nn.Linear, rows: int) -> Tensor:
    """``fc2(GELU(fc1(x)))`` on ``x`` ``(..., C)``, ``rows`` rows of the flattened leading dims per chunk
    (module docstring); ``(..., fc2.out_features)`` in the compute dtype (autocast's, else ``x``'s), the
    operands cast to it as ``nn.Linear`` under autocast does."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows per chunk must be a positive int, got {rows!r}")
    dtype = _compute_dtype(x)

    def cast(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(dtype)

    lead = x.shape[:-1]
    y, _h = _mlp_op(cast(x.reshape(-1, x.shape[-1])), cast(fc1.weight), cast(fc1.bias), cast(fc2.weight),
                    cast(fc2.bias), rows)
    return y.reshape(*lead, y.shape[-1])


class RowChunkedMLP(nn.Sequential):
    """``nn.Sequential(Linear(C, hidden), GELU(), Linear(hidden, C_out))`` (the same children and state-dict
    keys) whose forward runs :func:`row_chunked_mlp` where the hidden activation has at least
    ``min_elements`` entries and gradients are recorded (compiled or not); elsewhere the plain
    ``nn.Sequential`` (module docstring)."""

    def __init__(self, channels: int, hidden: int, out_channels: int | None = None, *,
                 min_elements: int = MIN_ELEMENTS, chunk_elements: int = CHUNK_ELEMENTS) -> None:
        super().__init__(nn.Linear(channels, hidden), nn.GELU(), nn.Linear(hidden, channels if out_channels is None
                                                                             else out_channels))
        if min_elements < 0 or chunk_elements < 1:
            raise ValueError(f"min_elements ({min_elements}) must be >= 0 and chunk_elements ({chunk_elements}) "
                             ">= 1")
        self.min_elements, self.chunk_elements = min_elements, chunk_elements

    def forward(self, x: Tensor) -> Tensor:
        fc1, act, fc2 = self[0], self[1], self[2]
        rows = x.numel() // x.shape[-1] if x.dim() else 1
        if rows * fc1.out_features < self.min_elements or not torch.is_grad_enabled() or act.approximate != "none":
            return super().forward(x)
        return row_chunked_mlp(x, fc1, fc2, max(1, self.chunk_elements // fc1.out_features))
