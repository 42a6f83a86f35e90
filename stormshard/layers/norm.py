"""Layer norm in the compute dtype: no fp32 round trip of the activations under autocast.

CUDA's autocast runs ``layer_norm`` in fp32: a bf16 activation is copied to fp32, normalised, and the
fp32 result is copied back to bf16 by the next linear; two activation-sized casts per norm, forward and
backward. :class:`LayerNorm` normalises the activation in its own dtype instead (torch's layer-norm
kernels accumulate the mean and variance in fp32 for bf16 / fp16 inputs), with the affine parameters
cast to that dtype (``channels`` elements). Outside autocast, or when the input already has the
parameters' dtype, it is ``nn.LayerNorm`` exactly. Parameter names are ``nn.LayerNorm``'s, so
checkpoints do not change. Layout: ``(..., channels)``. Nothing is communicated here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["LayerNorm", "layer_norm"]


class LayerNorm(nn.LayerNorm):
    """``nn.LayerNorm`` whose output keeps the input's dtype under autocast (statistics in fp32)."""

    def forward(self, x: Tensor) -> Tensor:
        if not torch.is_autocast_enabled(x.device.type) or x.dtype in (torch.float32, torch.float64):
            return super().forward(x)
        return layer_norm(x, self)


def layer_norm(x: Tensor, norm: nn.LayerNorm, weight: Tensor | None = None) -> Tensor:
    """``norm(x)`` as :class:`LayerNorm` computes it (under autocast in ``x``'s dtype), with ``weight`` in place of
    ``norm.weight`` where given (e.g. the weight seen through a collective whose backward sums its gradient)."""
    weight = norm.weight if weight is None else weight
    if not torch.is_autocast_enabled(x.device.type) or x.dtype in (torch.float32, torch.float64):
        return F.layer_norm(x, norm.normalized_shape, weight, norm.bias, norm.eps)
    weight = None if weight is None else weight.to(x.dtype)
    bias = None if norm.bias is None else norm.bias.to(x.dtype)
    with torch.autocast(x.device.type, enabled=False):
        return F.layer_norm(x, norm.normalized_shape, weight, bias, norm.eps)
