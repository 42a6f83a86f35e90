"""The transformer MLP: ``fc2(GELU(fc1(x)))`` on ``(..., channels)``, token-wise (no communication)."""

from __future__ import annotations

from torch import Tensor, nn

__all__ = ["MLP"]


class MLP(nn.Module):
    """Two linear layers with an exact (erf) GELU between: ``C -> mlp_ratio * C -> C``."""

    def __init__(self, num_channels: int, mlp_ratio: int = 4, bias: bool = True) -> None:
        super().__init__()
        if num_channels < 1 or mlp_ratio < 1:
            raise ValueError(
                f"num_channels ({num_channels}) and mlp_ratio ({mlp_ratio}) must be positive integers"
            )
        hidden = mlp_ratio * num_channels
        self.fc1 = nn.Linear(num_channels, hidden, bias=bias)
        self.activation = nn.GELU()
        self.fc2 = nn.Linear(hidden, num_channels, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        """``x`` ``(..., C)`` -> ``(..., C)``."""
        return self.fc2(self.activation(self.fc1(x)))
