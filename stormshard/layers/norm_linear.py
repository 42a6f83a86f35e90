"""Linear maps of a layer-normed input that keep the input, not the normed copy, for the backward.

``[F.linear(LayerNorm(x), w, b) for w, b]`` written as plain modules keeps ``LayerNorm(x)`` alive from the
forward to the backward (the linears' weight gradients read it) while ``x`` stays alive anyway (the layer norm's
own backward reads it, and a residual stream holds it). On the 543,088 data nodes of an AIFS-size decoder that is
one more (nodes, channels) activation, 1.0 GiB in bf16, per norm. :func:`norm_linear` keeps ``x`` and the norm's
per-row mean and inverse deviation, and recomputes the normed rows in the backward (one elementwise pass):

- forward: ``xn, mean, rstd = layer_norm(x)``, ``y_i = xn @ w_i.T + b_i``; ``xn`` is freed;
- backward: ``xn`` again (the same per-row arithmetic, the same numbers), ``dW_i = dy_i^T xn``, ``db_i =
  sum(dy_i)``, ``dxn = sum_i dy_i w_i``, then the layer norm's own backward for ``dx`` and its weight and bias.

The norm runs in ``x``'s dtype with its parameters cast to it (as :class:`~stormshard.layers.norm.LayerNorm`
does under autocast), the products in the autocast dtype where autocast is on (as ``nn.Linear`` would). The
forward and backward are custom ops (``stormshard::norm_linear``, ``..._backward``), so a compiled block keeps
what they keep. Layout: ``x`` ``(..., C)``, outputs ``(..., out_i)``; nothing is communicated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["norm_linear", "keeps_norm_input", "MIN_ELEMENTS", "layer_norm_in_dtype", "cast_like", "compute_dtype"]

#: inputs with fewer entries keep the plain composition (``linear(norm(x))``): their normed copy is small
MIN_ELEMENTS = 2 ** 26


def keeps_norm_input(x: Tensor, min_elements: int | None = MIN_ELEMENTS) -> bool:
    """Whether a block should project ``x`` by :func:`norm_linear`: gradients are recorded and ``x`` holds at
    least ``min_elements`` entries (None: never). The default, :data:`MIN_ELEMENTS`, is 128 MiB in bf16: an N320 /
    O364 grid from 128 channels on; not an O96 grid at 512 or 1,024 channels, where the saving is a few percent of
    the step's memory and the step is short, nor the CPU quickstart's sizes, whose numbers stay those of the plain
    composition. Blocks bind it at construction (``model.lean_activations``)."""
    return min_elements is not None and torch.is_grad_enabled() and x.numel() >= min_elements


def cast_like(t: Tensor | None, x: Tensor) -> Tensor | None:
    """``t`` in ``x``'s dtype (None stays None)."""
    return None if t is None else t.to(x.dtype)


def layer_norm_in_dtype(x: Tensor, w: Tensor | None, b: Tensor | None, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(normed x, mean, rstd)`` over the last dim, in ``x``'s dtype with the affine parameters cast to it (as
    :class:`~stormshard.layers.norm.LayerNorm` under autocast); the statistics as torch keeps them."""
    return torch.native_layer_norm(x, [x.shape[-1]], cast_like(w, x), cast_like(b, x), eps)


def compute_dtype(x: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype ``F.linear(x, weight)`` computes in: autocast's where it is on, else the promoted dtype."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return torch.promote_types(x.dtype, weight.dtype)


@torch.library.custom_op("stormshard::norm_linear", mutates_args=())
def _norm_linear_op(x: Tensor, norm_w: Tensor | None, norm_b: Tensor | None, eps: float, dtype: torch.dtype,
                    weights: list[Tensor], biases: list[Tensor]) -> tuple[list[Tensor], Tensor, Tensor]:
    """``([y_i], mean, rstd)``: ``y_i = layer_norm(x) @ w_i.T + b_i`` in ``dtype`` (empty ``b_i``: no bias)."""
    with torch.autocast(x.device.type, enabled=False):
        xn, mean, rstd = layer_norm_in_dtype(x, norm_w, norm_b, eps)
        xn = xn.to(dtype)
        outs = [F.linear(xn, w.to(dtype), b.to(dtype) if b.numel() else None) for w, b in zip(weights, biases,
                                                                                               strict=True)]
    return outs, mean, rstd


@_norm_linear_op.register_fake
def _norm_linear_fake(x: Tensor, norm_w: Tensor | None, norm_b: Tensor | None, eps: float, dtype: torch.dtype,
                      weights: list[Tensor], biases: list[Tensor]) -> tuple[list[Tensor], Tensor, Tensor]:
    _xn, mean, rstd = torch.native_layer_norm(x, [x.shape[-1]], None, None, eps)  # the statistics' shapes
    return [x.new_empty((*x.shape[:-1], w.shape[0]), dtype=dtype) for w in weights], mean, rstd


@torch.library.custom_op("stormshard::norm_linear_backward", mutates_args=())
def _norm_linear_backward_op(grads: list[Tensor], x: Tensor, mean: Tensor, rstd: Tensor, norm_w: Tensor | None,
                             norm_b: Tensor | None, eps: float, dtype: torch.dtype, weights: list[Tensor],
                             present: list[bool],
                             needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, list[Tensor], list[Tensor]]:
    """``(dx, d norm_w, d norm_b, [dw_i], [db_i])`` (empty where ``needs`` — x, norm_w, norm_b, then per weight
    its weight and bias — is False); ``present[i]`` False: output ``i`` took no gradient (``grads[i]`` empty)."""
    need_x, need_nw, need_nb = needs[:3]
    per = needs[3:]
    with torch.autocast(x.device.type, enabled=False):
        xn = layer_norm_in_dtype(x, norm_w, norm_b, eps)[0].to(dtype)
        flat = xn.reshape(-1, xn.shape[-1])
        dws, dbs = [], []
        dxn = None
        for i, (g, w) in enumerate(zip(grads, weights, strict=True)):
            if not present[i]:  # an output nothing took a gradient of
                dws.append(w.new_empty(0))
                dbs.append(w.new_empty(0))
                continue
            g2 = g.reshape(-1, g.shape[-1])
            dws.append((g2.t() @ flat).to(w.dtype) if per[2 * i] else w.new_empty(0))
            dbs.append(g2.sum(0, dtype=torch.promote_types(g2.dtype, torch.float32)).to(w.dtype)
                       if per[2 * i + 1] else w.new_empty(0))
            if need_x or need_nw or need_nb:
                term = g @ w.to(dtype)
                dxn = term if dxn is None else dxn.add_(term)
        del xn, flat
        if dxn is None:
            return x.new_empty(0), x.new_empty(0), x.new_empty(0), dws, dbs
        dx, dnw, dnb = torch.ops.aten.native_layer_norm_backward(
            dxn.to(x.dtype), x, [x.shape[-1]], mean, rstd, cast_like(norm_w, x), cast_like(norm_b, x),
            [need_x, need_nw, need_nb])
    return (dx if need_x else x.new_empty(0), dnw.to(norm_w.dtype) if need_nw else x.new_empty(0),
            dnb.to(norm_b.dtype) if need_nb else x.new_empty(0), dws, dbs)


@_norm_linear_backward_op.register_fake
def _norm_linear_backward_fake(grads: list[Tensor], x: Tensor, mean: Tensor, rstd: Tensor, norm_w: Tensor | None,
                               norm_b: Tensor | None, eps: float, dtype: torch.dtype, weights: list[Tensor],
                               present: list[bool], needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, list[Tensor], list[Tensor]]:
    def like(t: Tensor | None, shape: tuple, need: bool) -> Tensor:
        return t.new_empty(shape) if need and t is not None else x.new_empty(0)

    per = needs[3:]
    return (like(x, x.shape, needs[0]), like(norm_w, x.shape[-1:], needs[1]), like(norm_b, x.shape[-1:], needs[2]),
            [like(w, w.shape, per[2 * i]) for i, w in enumerate(weights)],
            [like(w, w.shape[:1], per[2 * i + 1]) for i, w in enumerate(weights)])


def _setup(ctx, inputs: tuple, output: tuple) -> None:  # noqa: ANN001
    x, norm_w, norm_b, eps, dtype, weights, biases = inputs
    _outs, mean, rstd = output
    ctx.save_for_backward(x, mean, rstd, norm_w, norm_b, *weights)
    ctx.eps, ctx.dtype, ctx.num, ctx.has_bias = eps, dtype, len(weights), [b.numel() > 0 for b in biases]
    ctx.has_norm = (norm_w is not None, norm_b is not None)
    ctx.set_materialize_grads(False)


def _op_backward(ctx, grads: list[Tensor | None], _dmean: Tensor | None, _drstd: Tensor | None) -> tuple:  # noqa: ANN001
    x, mean, rstd, norm_w, norm_b, *weights = ctx.saved_tensors
    n = ctx.needs_input_grad
    present = [g is not None for g in grads]
    if not any(present):
        return None, None, None, None, None, None, None
    grads = [g if g is not None else x.new_empty(0) for g in grads]  # empty: that output took no gradient
    need_w = bool(n[5])
    need_b = bool(n[6])
    per = [flag for has_b, has_g in zip(ctx.has_bias, present, strict=True)
           for flag in (need_w and has_g, need_b and has_b and has_g)]
    needs = [bool(n[0]), bool(n[1]) and ctx.has_norm[0], bool(n[2]) and ctx.has_norm[1], *per]
    dx, dnw, dnb, dws, dbs = torch.ops.stormshard.norm_linear_backward(grads, x, mean, rstd, norm_w, norm_b, ctx.eps,
                                                                       ctx.dtype, weights, present, needs)
    return (dx if needs[0] else None, dnw if needs[1] else None, dnb if needs[2] else None, None, None,
            [d if need else None for d, need in zip(dws, per[0::2], strict=True)] if need_w else None,
            [d if need else None for d, need in zip(dbs, per[1::2], strict=True)] if need_b else None)


_norm_linear_op.register_autograd(_op_backward, setup_context=_setup)


def norm_linear(x: Tensor, norm: nn.LayerNorm, linears: Sequence[nn.Linear]) -> list[Tensor]:
    """``[linear(norm(x)) for linear in linears]`` keeping ``x`` (not ``norm(x)``) for the backward (module
    docstring). ``norm`` is a :class:`~stormshard.layers.norm.LayerNorm` (or ``nn.LayerNorm``) over the last dim;
    outputs in the compute dtype (autocast's, else the promoted dtype of ``x`` and the weights)."""
    if len(norm.normalized_shape) != 1 or norm.normalized_shape[0] != x.shape[-1]:
        raise ValueError(f"norm_linear needs a layer norm over the last dim ({x.shape[-1]}), got normalized_shape "
                         f"{tuple(norm.normalized_shape)}")
    weights = [lin.weight for lin in linears]
    dtype = compute_dtype(x, weights[0])
    biases = [lin.bias if lin.bias is not None else lin.weight.new_empty(0) for lin in linears]
    outs, _mean, _rstd = _norm_linear_op(x.contiguous(), norm.weight, norm.bias, float(norm.eps), dtype, weights,
                                         biases)
    return outs
