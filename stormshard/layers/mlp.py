"""The blocks' MLPs on ``(..., channels)``, token-wise (no communication): ``fc2(GELU(fc1(x)))``, or a gated MLP
``fc2(act(gate(x)) * value(x))`` (``kind``: :mod:`stormshard.layers.mlp_kinds`, anemoi-models' ``mlp_implementation``).

A gated MLP keeps ``fc1`` / ``fc2``: ``fc1`` projects to ``2 x hidden`` features that interleave, per hidden
channel ``i``, its gate (row ``2 i``) and its value (row ``2 i + 1``); :class:`GatedActivation` pairs them. So a
contiguous block of ``fc1``'s rows holds whole (gate, value) pairs: a column-parallel slice of ``fc1`` (tensor
parallelism, :mod:`stormshard.layers.tensor_parallel`) holds the gates and values of the same hidden channels as
the row-parallel slice of ``fc2``, whatever the group size, and the state dict does not depend on it. anemoi's
``gate_proj`` / ``value_proj`` weights are ``fc1.weight[0::2]`` / ``fc1.weight[1::2]``.
"""

from __future__ import annotations

from torch import Tensor, nn

from stormshard.layers.mlp_kinds import GATED_KINDS, MLP_KINDS, MLPKind

__all__ = ["MLP", "GatedActivation", "block_activation", "check_mlp_kind", "fc1_width", "mlp_hidden_width"]

_GATES: dict[str, type[nn.Module]] = {"glu": nn.Sigmoid, "swiglu": nn.SiLU, "geglu": nn.GELU, "reglu": nn.ReLU}


def check_mlp_kind(kind: str) -> None:
    """Raise ValueError unless ``kind`` is one of :data:`~stormshard.layers.mlp_kinds.MLP_KINDS`."""
    if kind not in MLP_KINDS:
        raise ValueError(f"the MLP kind (mlp_implementation) must be one of {MLP_KINDS}, got {kind!r}")


def mlp_hidden_width(channels: int, ratio: float) -> int:
    """A block MLP's hidden width ``channels x ratio``, rounded (Python's ``round``), at least 1; for a gated MLP
    the width of its gate and of its value. anemoi rounds halves up: the two agree unless the product is a
    half-integer (``export-anemoi`` refuses those)."""
    if not ratio > 0:
        raise ValueError(f"mlp_ratio must be positive, got {ratio}")
    return max(1, int(round(channels * ratio)))


def fc1_width(hidden: int, kind: MLPKind) -> int:
    """``fc1``'s output features: ``hidden``, or ``2 x hidden`` (gate and value) for a gated kind."""
    check_mlp_kind(kind)
    return 2 * hidden if kind in GATED_KINDS else hidden


class GatedActivation(nn.Module):
    """A gated MLP's middle: ``(..., (hidden two))`` -> ``act(gate) * value`` ``(..., hidden)``, gate and value
    interleaved per hidden channel (module docstring). No parameters."""

    def __init__(self, kind: MLPKind) -> None:
        super().__init__()
        if kind not in GATED_KINDS:
            raise ValueError(f"a gated activation's kind must be one of {GATED_KINDS}, got {kind!r}")
        self.kind = kind
        self.gate = _GATES[kind]()

    def extra_repr(self) -> str:
        return f"kind={self.kind}"

    def forward(self, x: Tensor) -> Tensor:
        pairs = x.unflatten(-1, (-1, 2))
        return self.gate(pairs[..., 0]) * pairs[..., 1]


def block_activation(kind: MLPKind) -> nn.Module:
    """The module between ``fc1`` and ``fc2``: exact GELU (``"mlp"``) or a :class:`GatedActivation`."""
    check_mlp_kind(kind)
    return nn.GELU() if kind == "mlp" else GatedActivation(kind)


class MLP(nn.Module):
    """``fc1``, an activation, ``fc2``: ``C -> hidden -> C`` with ``hidden`` = :func:`mlp_hidden_width` (``C x
    mlp_ratio``); ``kind`` ``"mlp"``: exact (erf) GELU; a gated kind: ``fc1`` ``C -> 2 x hidden`` (module
    docstring)."""

    def __init__(self, num_channels: int, mlp_ratio: float = 4, bias: bool = True, kind: MLPKind = "mlp") -> None:
        super().__init__()
        if num_channels < 1 or not mlp_ratio > 0:
            raise ValueError(
                f"num_channels ({num_channels}) must be a positive integer and mlp_ratio ({mlp_ratio}) positive"
            )
        hidden = mlp_hidden_width(num_channels, mlp_ratio)
        self.kind = kind
        self.fc1 = nn.Linear(num_channels, fc1_width(hidden, kind), bias=bias)
        self.activation = block_activation(kind)
        self.fc2 = nn.Linear(hidden, num_channels, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``(..., C)`` -> ``(..., C)``."""
        return self.fc2(self.activation(self.fc1(x)))
