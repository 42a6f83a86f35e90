"""An estimate of the activation memory one rank holds for backward, at a given rollout.

Training backpropagates through the whole rollout, so the activations of every rollout step are
alive at once: memory grows linearly with the rollout, and a rollout schedule that ends at 12
steps needs about 12 times the memory of its first step. :func:`estimate_activation_memory`
counts, per rank (its grid and hidden-node slices), per sample (times members) and per rollout
step, the elements autograd keeps:

- each processor layer: ``hidden_local * C * (8 + 2 * mlp_ratio)`` (norms, q/k/v, attention
  output, projection, MLP hidden and activation; the banded attention recomputes its scores); with
  ``model.activation_checkpointing`` only the layer input ``hidden_local * C`` stays, plus one
  layer recomputed at a time; ``"selective"`` keeps the attention output too (``2 * hidden_local * C``
  per layer);
- graph-transformer encoder and decoder (every built-in model but ``gnn``), on the data nodes:
  the encoder keeps the data embedding, its norm and the keys and values (``4 C``; ``3 C`` where
  the norm runs inside the projections), the decoder its queries, norms, attention output,
  residual stream and output (``6 C``; ``4 C`` lean) and the MLP's hidden activations
  (``2 * mlp_ratio * C``; ``mlp_ratio * C`` row-chunked); no per-edge tensor (the edge term is
  factored); with ``model.encoder.activation_checkpointing`` the encoder keeps its input only (``C``;
  its keys, values and norms are remade in its own backward, after the peak). The lean figures apply
  with ``model.lean_activations`` above the blocks' thresholds
  (:mod:`stormshard.layers.norm_linear`, :mod:`stormshard.layers.row_chunked_mlp`);
- the GNN model (``gnn``): its encoder, processor and decoder blocks by their edges and widths
  (:mod:`~stormshard.training.gnn_activation_memory`; ``graph_mappers=False`` without a shape: the
  older figure, ``data_local * C * (8 + 2 * mapper_mlp_ratio)`` per mapper plus 3 edges per data node
  of ``3 C``).

Once per run it adds the backward's transient at its peak (the decoder's activation gradients,
and its MLP's hidden ones where the MLP is not row-chunked). It is meant to catch a rollout
schedule whose last stage cannot fit, before a run reaches it. Checked against
``benchmarks/bench_memory.py``'s simulation of one step (the step's allocations at its peak, rollout
1): 0.91x and 1.08x of it at the benchmark's tiny sizes (``tests/test_memory_simulation.py``),
0.93x at O96 -> O48 (512 channels), 1.04x at the AIFS size (1.22x with ``lean_activations`` off; 1.03x with
selective checkpointing, 1.08-1.09x with the encoder checkpointed too).
Bytes per element: 2 for ``training.precision: bf16``, else 4.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from stormshard.graphs.grids import grid_from_name
from stormshard.graphs.icosahedral import icosahedral_num_nodes
from stormshard.layers.norm_linear import MIN_ELEMENTS as NORM_LINEAR_MIN_ELEMENTS
from stormshard.layers.row_chunked_mlp import MIN_ELEMENTS as MLP_MIN_ELEMENTS
from stormshard.training.gnn_activation_memory import GNNShape, gnn_activation_elements

__all__ = ["ActivationEstimate", "estimate_activation_memory", "device_memory_bytes", "hidden_nodes"]

_EDGES_PER_DATA_NODE = 3


@dataclass(frozen=True)
class ActivationEstimate:
    """Bytes one rank keeps for backward: ``per_step`` per rollout step, plus once the ``transient`` the
    backward makes at its peak (the decoder's gradients); ``total`` at ``rollout``."""

    per_step: int
    rollout: int
    samples: int  # micro batch x members on this rank
    transient: int = 0

    @property
    def total(self) -> int:
        return self.per_step * self.rollout + self.transient

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
                               activation_checkpointing: bool | str, samples: int, rollout: int,
                               bytes_per_element: int = 4, graph_mappers: bool = True,
                               lean: bool = True, encoder_checkpointing: bool | str = False,
                               gnn: GNNShape | None = None) -> ActivationEstimate:
    """The estimate of the module docstring for one rank of a model group of ``gpus_per_model``:
    ``activation_checkpointing`` false, true / ``"full"`` or ``"selective"``, ``graph_mappers``
    graph-transformer encoder and decoder (False: GNN ones), ``lean`` the blocks' ``model.lean_activations``,
    ``encoder_checkpointing`` ``model.encoder.activation_checkpointing``, ``gnn`` the GNN model's shape
    (:func:`~stormshard.training.gnn_activation_memory.gnn_shape`: its processor and mappers by their edges)."""
    if gnn is not None:
        per_sample, transient = gnn_activation_elements(
            gnn, channels=num_channels, gpus_per_model=gpus_per_model, num_layers=num_layers,
            checkpointing=activation_checkpointing, encoder_checkpointing=encoder_checkpointing, data_cells=data_cells)
        return ActivationEstimate(per_step=int(np.ceil(per_sample * samples * bytes_per_element)), rollout=rollout,
                                  samples=samples, transient=int(np.ceil(transient * samples * bytes_per_element)))
    data_local = -(-data_cells // gpus_per_model)
    hidden_local = -(-hidden // gpus_per_model)
    c = num_channels
    layer = hidden_local * c * (8 + 2 * mlp_ratio)
    if activation_checkpointing:  # the layer inputs (and, selective, the attention outputs), one layer recomputed
        kept = 2 if activation_checkpointing == "selective" else 1
        processor = num_layers * kept * hidden_local * c + layer
    else:
        processor = num_layers * layer
    rows = data_local * samples  # the blocks' thresholds count the rows of every sample
    if graph_mappers:
        norms_inside = lean and rows * c >= NORM_LINEAR_MIN_ELEMENTS
        mlp_chunked = lean and rows * max(1, round(c * mapper_mlp_ratio)) >= MLP_MIN_ELEMENTS
        encoder = data_local * c * (1 if encoder_checkpointing else 3 if norms_inside else 4)
        decoder = data_local * c * ((4 if norms_inside else 6) + mapper_mlp_ratio * (1 if mlp_chunked else 2))
        mappers = encoder + decoder
        # the decoder's backward: two activation gradients, and the MLP's two hidden ones unless row-chunked
        transient = data_local * c * (2 + (0 if mlp_chunked else 2 * mapper_mlp_ratio))
    else:
        gnn_mapper = data_local * c * (8 + 2 * mapper_mlp_ratio) + _EDGES_PER_DATA_NODE * data_local * 3 * c
        mappers = (data_local * c if encoder_checkpointing else gnn_mapper) + gnn_mapper
        transient = data_local * c * (2 + 2 * mapper_mlp_ratio)
    per_step = int(np.ceil((processor + mappers) * samples * bytes_per_element))
    return ActivationEstimate(per_step=per_step, rollout=rollout, samples=samples,
                              transient=int(np.ceil(transient * samples * bytes_per_element)))


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
