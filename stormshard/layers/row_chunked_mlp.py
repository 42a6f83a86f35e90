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
two from the forward to the backward (8 GiB less at the AIFS decoder's peak). With ``norm`` (the block's
pre-MLP layer norm, ``mlp(x, norm)``) the norm runs inside the op: it keeps ``x`` and the norm's per-row
statistics instead of ``norm(x)``, recomputes each chunk's normed rows in the backward and runs the norm's own
backward per chunk. Under autocast the products run in the autocast dtype as ``nn.Linear``'s would, and the
gradients come back in the parameters' dtype. The rows' forward values are those of the plain MLP (the same products on the same
rows; a chunk's rows are a contiguous slice of the same GEMM's operands); gradients differ from the plain MLP's
by the order of the sums over row chunks (float64: below 1e-12 relative).

It runs only where it pays: :class:`RowChunkedMLP` takes the plain path (bit for bit the ``nn.Sequential``) when
its hidden activation has fewer than ``min_elements`` entries (``2**27``, 256 MiB in bf16: never at the CPU
quickstart's sizes nor at O96, always at an N320 / O364 decoder; None: never, ``model.lean_activations``
false) and without gradients. The forward and the
backward are custom ops (``stormshard::row_chunked_mlp``, ``..._backward``), so a compiled block keeps what they
keep: traced as plain operators, inductor's partitioner would save every chunk's GELU output again.
A gated MLP (``kind`` ``glu`` / ``swiglu`` / ``geglu`` / ``reglu``, :mod:`stormshard.layers.mlp`: ``fc1``'s rows
interleave a gate and a value per hidden channel) runs the same way: ``h`` is ``fc1``'s ``2 x hidden`` output, each
chunk's ``act(gate) * value`` is recomputed in the backward and its gradient formed per chunk (plain autograd keeps
``h``, ``act(gate)`` and the product: two hidden activations more).
Layout: ``x`` ``(rows, *batch, C)``, any leading shape; nothing is communicated.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from stormshard.layers.mlp import GatedActivation, fc1_width
from stormshard.layers.mlp_kinds import MLPKind
from stormshard.layers.norm_linear import cast_like, compute_dtype, layer_norm_in_dtype

__all__ = ["RowChunkedMLP", "row_chunked_mlp", "MIN_ELEMENTS", "CHUNK_ELEMENTS"]

#: hidden activations with fewer entries run the plain MLP
MIN_ELEMENTS = 2 ** 27
#: entries of one chunk's hidden activation (128 MiB in bf16; at least one row)
CHUNK_ELEMENTS = 2 ** 26


def _normed(x: Tensor, norm_w: Tensor | None, norm_b: Tensor | None, eps: float,
            dtype: torch.dtype) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(layer_norm(x) in dtype, mean, rstd)`` where ``eps >= 0``
    (:func:`~stormshard.layers.norm_linear.layer_norm_in_dtype`), else ``(x in dtype, None, None)``."""
    if eps < 0:
        return x.to(dtype), None, None
    xn, mean, rstd = layer_norm_in_dtype(x, norm_w, norm_b, eps)
    return xn.to(dtype), mean, rstd


_GATES = {"glu": torch.sigmoid, "swiglu": F.silu, "geglu": F.gelu, "reglu": torch.relu}


def _activate(h: Tensor, kind: str) -> Tensor:
    """The MLP's middle on ``fc1``'s output rows: GELU (``"mlp"``), else ``act(gate) * value`` of the interleaved
    ``(R, (hidden two))`` (:class:`~stormshard.layers.mlp.GatedActivation`)."""
    if kind == "mlp":
        return F.gelu(h)
    pairs = h.unflatten(-1, (-1, 2))
    return _GATES[kind](pairs[..., 0]) * pairs[..., 1]


def _activate_backward(dg: Tensor, h: Tensor, kind: str) -> Tensor:
    """The gradient of :func:`_activate` at ``h`` for the output gradient ``dg``: ``(R, hidden)`` -> ``h``'s shape."""
    if kind == "mlp":
        return torch.ops.aten.gelu_backward(dg, h)
    pairs = h.unflatten(-1, (-1, 2))
    gate, value = pairs[..., 0], pairs[..., 1]
    if kind == "glu":
        a = torch.sigmoid(gate)
        d_gate = dg * value * a * (1 - a)
    elif kind == "swiglu":
        a = F.silu(gate)
        d_gate = torch.ops.aten.silu_backward(dg * value, gate)
    elif kind == "geglu":
        a = F.gelu(gate)
        d_gate = torch.ops.aten.gelu_backward(dg * value, gate)
    else:  # reglu
        a = torch.relu(gate)
        d_gate = torch.ops.aten.threshold_backward(dg * value, a, 0)
    return torch.stack([d_gate, dg * a], dim=-1).flatten(-2)


@torch.library.custom_op("stormshard::row_chunked_mlp", mutates_args=())
def _mlp_op(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, rows: int,
            norm_w: Tensor | None, norm_b: Tensor | None, eps: float,
            kind: str = "mlp") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(y (R, C_out), h (R, fc1 features), mean, rstd)`` for ``x`` ``(R, C)``, the products in ``w1``'s dtype; with
    ``eps >= 0`` ``x`` is layer-normed first (``mean`` / ``rstd`` its statistics, else empty); ``kind``: GELU
    (``"mlp"``) or a gated kind."""
    with torch.autocast(x.device.type, enabled=False):
        xn, mean, rstd = _normed(x, norm_w, norm_b, eps, w1.dtype)
        h = F.linear(xn, w1, b1)
        del xn
        y = h.new_empty(h.shape[0], w2.shape[0])
        for first in range(0, h.shape[0], rows):
            end = min(first + rows, h.shape[0])
            y[first:end] = F.linear(_activate(h[first:end], kind), w2, b2)
    empty = x.new_empty(0, dtype=torch.float32)
    return y, h, empty if mean is None else mean, empty.clone() if rstd is None else rstd


@_mlp_op.register_fake
def _mlp_fake(x: Tensor, w1: Tensor, b1: Tensor | None, w2: Tensor, b2: Tensor | None, rows: int,
              norm_w: Tensor | None, norm_b: Tensor | None, eps: float,
              kind: str = "mlp") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if eps >= 0:
        _xn, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], None, None, eps)
    else:
        mean, rstd = x.new_empty(0, dtype=torch.float32), x.new_empty(0, dtype=torch.float32)
    return x.new_empty(x.shape[0], w2.shape[0], dtype=w1.dtype), x.new_empty(x.shape[0], w1.shape[0],
                                                                              dtype=w1.dtype), mean, rstd


@torch.library.custom_op("stormshard::row_chunked_mlp_backward", mutates_args=())
def _mlp_backward_op(dy: Tensor, x: Tensor, w1: Tensor, w2: Tensor, h: Tensor, rows: int, norm_w: Tensor | None,
                     norm_b: Tensor | None, eps: float, mean: Tensor, rstd: Tensor, needs: list[bool],
                     kind: str = "mlp") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of ``(x, w1, b1, w2, b2, norm_w, norm_b)`` (empty where ``needs`` is False), per row chunk;
    weight and bias gradients summed in fp32 (or float64) and returned in the parameters' dtype. With a norm
    (``eps >= 0``) each chunk's normed rows are recomputed from ``x`` and the norm's backward runs per chunk."""
    need_x, need_w1, need_b1, need_w2, need_b2, need_nw, need_nb = needs
    normed = eps >= 0
    acc = torch.promote_types(h.dtype, torch.float32)
    dx = torch.empty_like(x) if need_x else x.new_empty(0)

    def zeros(t: Tensor | None, shape: tuple, need: bool) -> Tensor:
        return torch.zeros(shape, dtype=acc, device=h.device) if need and t is not None else h.new_empty(0)

    dw1, db1, dw2, db2 = zeros(w1, w1.shape, need_w1), zeros(w1, w1.shape[:1], need_b1), \
        zeros(w2, w2.shape, need_w2), zeros(w2, w2.shape[:1], need_b2)
    dnw, dnb = zeros(norm_w, x.shape[-1:], need_nw), zeros(norm_b, x.shape[-1:], need_nb)
    with torch.autocast(h.device.type, enabled=False):
        dy = dy.to(h.dtype)
        for first in range(0, h.shape[0], rows):
            end = min(first + rows, h.shape[0])
            h_c, dy_c = h[first:end], dy[first:end]
            if need_w2:
                dw2 += torch.mm(dy_c.t(), _activate(h_c, kind)).to(acc)
            if need_b2:
                db2 += dy_c.sum(0, dtype=acc)
            dh_c = _activate_backward(torch.mm(dy_c, w2), h_c, kind)
            x_c = x[first:end]
            if need_w1:
                xn_c = _normed(x_c, norm_w, norm_b, eps, h.dtype)[0] if normed else x_c
                dw1 += torch.mm(dh_c.t(), xn_c).to(acc)
            if need_b1:
                db1 += dh_c.sum(0, dtype=acc)
            if not (need_x or need_nw or need_nb):
                continue
            dxn_c = torch.mm(dh_c, w1)
            if not normed:
                dx[first:end] = dxn_c
                continue
            g_x, g_w, g_b = torch.ops.aten.native_layer_norm_backward(
                dxn_c.to(x.dtype), x_c, [x.shape[-1]], mean[first:end], rstd[first:end], cast_like(norm_w, x),
                cast_like(norm_b, x),
                [need_x, need_nw and norm_w is not None, need_nb and norm_b is not None])
            if need_x:
                dx[first:end] = g_x
            if need_nw and norm_w is not None:
                dnw += g_w.to(acc)
            if need_nb and norm_b is not None:
                dnb += g_b.to(acc)

    def out(g: Tensor, like: Tensor | None) -> Tensor:
        return g if not g.numel() or like is None else g.to(like.dtype)

    return dx, out(dw1, w1), out(db1, w1), out(dw2, w2), out(db2, w2), out(dnw, norm_w), out(dnb, norm_b)


@_mlp_backward_op.register_fake
def _mlp_backward_fake(dy: Tensor, x: Tensor, w1: Tensor, w2: Tensor, h: Tensor, rows: int, norm_w: Tensor | None,
                       norm_b: Tensor | None, eps: float, mean: Tensor, rstd: Tensor, needs: list[bool],
                       kind: str = "mlp") -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    likes = (x, w1, w1, w2, w2, norm_w, norm_b)
    shapes = (x.shape, w1.shape, w1.shape[:1], w2.shape, w2.shape[:1], x.shape[-1:], x.shape[-1:])
    return tuple(t.new_empty(shape) if need and t is not None else h.new_empty(0)
                 for t, shape, need in zip(likes, shapes, needs, strict=True))


def _setup(ctx, inputs: tuple, output: tuple) -> None:  # noqa: ANN001
    x, w1, b1, w2, b2, rows, norm_w, norm_b, eps, kind = inputs
    _y, h, mean, rstd = output
    ctx.save_for_backward(x, w1, w2, h, norm_w, norm_b, mean, rstd)
    ctx.rows, ctx.eps, ctx.kind = rows, eps, kind
    ctx.has = (b1 is not None, b2 is not None, norm_w is not None, norm_b is not None)
    ctx.set_materialize_grads(False)  # no (rows, hidden) zeros for h's gradient, which nothing produces


def _op_backward(ctx, dy: Tensor | None, _dh: Tensor | None, _dmean: Tensor | None,  # noqa: ANN001
                 _drstd: Tensor | None) -> tuple:
    x, w1, w2, h, norm_w, norm_b, mean, rstd = ctx.saved_tensors
    if dy is None:
        return (None,) * 10
    n = ctx.needs_input_grad
    has_b1, has_b2, has_nw, has_nb = ctx.has
    needs = [bool(n[0]), bool(n[1]), bool(n[2]) and has_b1, bool(n[3]), bool(n[4]) and has_b2,
             bool(n[6]) and has_nw, bool(n[7]) and has_nb]
    grads = torch.ops.stormshard.row_chunked_mlp_backward(dy, x, w1, w2, h, ctx.rows, norm_w, norm_b, ctx.eps, mean,
                                                          rstd, needs, ctx.kind)
    g = [gr if need else None for gr, need in zip(grads, needs, strict=True)]
    return g[0], g[1], g[2], g[3], g[4], None, g[5], g[6], None, None


_mlp_op.register_autograd(_op_backward, setup_context=_setup)


def row_chunked_mlp(x: Tensor, fc1: nn.Linear, fc2: nn.Linear, rows: int, norm: nn.LayerNorm | None = None,
                    kind: MLPKind = "mlp") -> Tensor:
    """``fc2(GELU(fc1(norm(x))))`` on ``x`` ``(..., C)`` (no norm: ``fc2(GELU(fc1(x)))``; a gated ``kind``:
    ``act(gate) * value`` in GELU's place), ``rows`` rows of the flattened leading dims per chunk (module docstring);
    ``(..., fc2.out_features)`` in the compute dtype (autocast's, else ``x``'s), the operands cast to it as
    ``nn.Linear`` under autocast does. With ``norm`` (a layer norm over the last dim) ``x`` is kept for the
    backward instead of ``norm(x)``."""
    if isinstance(rows, bool) or not isinstance(rows, int) or rows < 1:
        raise ValueError(f"rows per chunk must be a positive int, got {rows!r}")
    if norm is not None and (len(norm.normalized_shape) != 1 or norm.normalized_shape[0] != x.shape[-1]):
        raise ValueError(f"the MLP's norm must normalise the last dim ({x.shape[-1]}), got normalized_shape "
                         f"{tuple(norm.normalized_shape)}")
    dtype = compute_dtype(x, fc1.weight)

    def cast(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.to(dtype)

    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    if norm is None:
        args = (cast(flat), None, None, -1.0)
    else:  # normed in x's own dtype (its parameters cast to it), then the products in the compute dtype
        args = (flat, norm.weight, norm.bias, float(norm.eps))
    y, _h, _mean, _rstd = _mlp_op(args[0], cast(fc1.weight), cast(fc1.bias), cast(fc2.weight), cast(fc2.bias), rows,
                                  *args[1:], kind)
    return y.reshape(*lead, y.shape[-1])


class RowChunkedMLP(nn.Sequential):
    """``nn.Sequential(Linear(C, hidden), GELU(), Linear(hidden, C_out))`` (the same children and state-dict
    keys; a gated ``kind``: ``Linear(C, 2 x hidden)``, :class:`~stormshard.layers.mlp.GatedActivation`, ``Linear``)
    whose forward runs :func:`row_chunked_mlp` where ``fc1``'s output has at least ``min_elements`` entries (None:
    never) and gradients are recorded (compiled or not); elsewhere the plain ``nn.Sequential`` (module docstring)."""

    def __init__(self, channels: int, hidden: int, out_channels: int | None = None, *,
                 min_elements: int | None = MIN_ELEMENTS, chunk_elements: int = CHUNK_ELEMENTS,
                 kind: MLPKind = "mlp") -> None:
        super().__init__(nn.Linear(channels, fc1_width(hidden, kind)),
                         nn.GELU() if kind == "mlp" else GatedActivation(kind),
                         nn.Linear(hidden, channels if out_channels is None else out_channels))
        if (min_elements is not None and min_elements < 0) or chunk_elements < 1:
            raise ValueError(f"min_elements ({min_elements}) must be >= 0 (None: never chunked) and chunk_elements "
                             f"({chunk_elements}) >= 1")
        self.min_elements, self.chunk_elements = min_elements, chunk_elements

    def forward(self, x: Tensor, norm: nn.LayerNorm | None = None) -> Tensor:
        """``self(norm(x))`` (``norm`` None: ``self(x)``); on the chunked path ``x`` is kept, not ``norm(x)``."""
        fc1, act, fc2 = self[0], self[1], self[2]
        rows = x.numel() // x.shape[-1] if x.dim() else 1
        kind = act.kind if isinstance(act, GatedActivation) else "mlp"
        if (self.min_elements is None or rows * fc1.out_features < self.min_elements or not torch.is_grad_enabled()
                or kind == "mlp" and act.approximate != "none"):
            return super().forward(x if norm is None else norm(x))
        return row_chunked_mlp(x, fc1, fc2, max(1, self.chunk_elements // fc1.out_features), norm, kind)
