"""The block MLPs' kinds (``model.processor / encoder / decoder.mlp_implementation``, anemoi-models' names), torch-free
so that the model config validates without torch.

``"mlp"``: ``fc2(GELU(fc1(x)))``; the gated kinds ``fc2(act(gate(x)) * value(x))`` with the gate's activation
``glu``: sigmoid, ``swiglu``: SiLU, ``geglu``: GELU (exact), ``reglu``: ReLU (anemoi-models' ``GatedMLPLayer``;
:class:`~stormshard.layers.mlp.GatedActivation` holds the layout).
"""

from __future__ import annotations

from typing import Literal, get_args

__all__ = ["MLPKind", "MLP_KINDS", "GATED_KINDS"]

MLPKind = Literal["mlp", "glu", "swiglu", "geglu", "reglu"]
#: every kind, ``"mlp"`` (the default, ungated) first
MLP_KINDS: tuple[str, ...] = get_args(MLPKind)
#: the gated kinds (their first linear holds a gate and a value row per hidden channel)
GATED_KINDS: tuple[str, ...] = MLP_KINDS[1:]
