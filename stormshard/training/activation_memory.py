"""An estimate of the activation memory one rank holds for backward, at a given rollout.

Training backpropagates through the whole rollout, so the activations of every rollout step are
alive at once: memory grows linearly with the rollout, and a rollout schedule that ends at 12
steps needs about 12 times the memory of its first step. :func:`estimate_activation_memory`
counts, per rank (its grid and hidden-node slices), per sample (times members) and per rollout
step, the elements autograd keeps:

- each processor layer: ``hidden_local * C * (8 + 2 * mlp_ratio)`` (norms, q/k/v, attention
  output, projection, MLP hidden and activation; the banded attention recomputes its scores); with
  ``model.activation_checkpointing`` only the layer input ``hidden_local * C`` stays, plus one
  layer recomputed at a time;
- encoder and decoder: ``data_local * C * (8 + 2 * mlp_ratio)`` each, plus edge messages, about 3
  edges per data node of ``3 * C`` each.

It is an order-of-magnitude estimate (within a factor of about 2 of what autograd holds; the
exact figure depends on the kernels), meant to catch a rollout schedule whose last stage cannot
fit, before a run reaches it. Bytes per element: 2 for ``training.precision: bf16``, else 4.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from stormshard.graphs.grids import grid_from_name
from stormshard.graphs.icosahedral import icosahedral_num_nodes

__all__ = ["ActivationEstimate", "estimate_activation_memory", "device_memory_bytes", "hidden_nodes"]

_EDGES_PER_DATA_NODE = 3


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes one rank keeps for backward: ``per_step`` per rollout step, ``total`` at ``rollout``."""

    per_step: int
    rollout: int
    samples: int  # micro batch x members on this rank

    @property
    def total(self) -> int:
        return self.per_step * self.rollout

    def describe(self) -> str:
        return (f"{self.total / 2**30:.2f} GiB of activations per rank at rollout {self.rollout} "
                f"({self.per_step / 2**30:.3f} GiB per step, {self.samples} sample(s) per micro-batch)")


def hidden_nodes(hidden: str) -> int:
    """Nodes of the hidden grid ``hidden`` (``"ico<r>"`` or a grid name such as ``"o96"``)."""
    if hidden.startswith("ico"):
        return icosahedral_num_nodes(int(hidden[3:]))
    return len(grid_from_name(hidden)[0])


def estimate_activation_memory(*, data_cells: int, hidden: int, gpus_per_model: int, num_channels: int,
                               num_layers: int, mlp_ratio: float, mapper_mlp_ratio: float,
                               activation_checkpointing: bool, samples: int, rollout: int,
                               bytes_per_element: int = 4) -> ActivationEstimate:
    """The estimate of the module docstring for one rank of a model group of ``gpus_per_model``."""
    data_local = -(-data_cells // gpus_per_model)
    hidden_local = -(-hidden // gpus_per_model)
    c = num_channels
    layer = hidden_local * c * (8 + 2 * mlp_ratio)
    processor = (num_layers * hidden_local * c + layer) if activation_checkpointing else num_layers * layer
    mapper = data_local * c * (8 + 2 * mapper_mlp_ratio) + _EDGES_PER_DATA_NODE * data_local * 3 * c
    per_step = int(np.ceil((processor + 2 * mapper) * samples * bytes_per_element))
    return ActivationEstimate(per_step=per_step, rollout=rollout, samples=samples)


def device_memory_bytes() -> tuple[int, str]:
    """Memory of this rank's device and its name: the CUDA device's, else the host's physical memory."""
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        return int(props.total_memory), props.name
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")), "host memory"
    except (ValueError, OSError, AttributeError):
        return 0, "unknown"
