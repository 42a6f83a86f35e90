"""A truncated residual: the carried state passed through a coarser grid and back (anemoi's ``TruncatedConnection``).

``A_down`` ``(truncation, data)`` averages the data nodes onto the truncation grid and ``A_up`` ``(data,
truncation)`` interpolates back; the residual is ``A_up @ (A_down @ x)`` per batch entry and variable: the state
with the scales below the truncation grid's removed. The matrices come from the graph
(:data:`~stormshard.graphs.builder.TRUNCATION_DOWN` / ``TRUNCATION_UP`` edges and their ``edge_weight``).

With the grid sharded by data rows (:class:`~stormshard.parallel.shard.SequenceShard`), this rank keeps ``A_down``'s
columns and ``A_up``'s rows of its slice: its partial sum ``A_down[:, local] @ x_local`` is summed over the group
(all ranks then hold the whole, small truncation field) and ``A_up[local, :]`` maps it back to this rank's rows. No
data row is gathered.
"""

from __future__ import annotations

from einops import rearrange
from torch import Tensor, nn

from stormshard.kernels.sparse_projection import CsrPair, csr_pair, sparse_project
from stormshard.parallel.comm import copy_tensor, reduce_tensor
from stormshard.parallel.shard import SequenceShard

__all__ = ["TruncatedResidual"]

_PAIR = CsrPair._fields


class TruncatedResidual(nn.Module):
    """``x -> A_up @ (A_down @ x)`` over the grid, sharded by data rows as ``shard`` says.

    ``x`` ``(batch, grid_local, vars)`` -> ``(batch, grid_local, vars)`` in ``x``'s dtype (autocast off: the carried
    state is never rounded to bf16); differentiable in ``x`` (a rollout's later steps carry a prediction).
    ``down_index`` ``(2, E_down)`` (row 0: data node, row 1: truncation node) with ``down_weight`` ``(E_down,)``;
    ``up_index`` ``(2, E_up)`` (row 0: truncation node, row 1: data node) with ``up_weight``: global node ids.
    Communicates: one all-reduce of the ``(truncation, batch * vars)`` partial sums in the forward and one of their
    gradient in the backward; nothing on one rank.
    """

    def __init__(self, down_index: Tensor, down_weight: Tensor, up_index: Tensor, up_weight: Tensor,
                 num_truncation: int, shard: SequenceShard) -> None:
        super().__init__()
        self.shard, self.num_truncation = shard, int(num_truncation)
        start, stop = shard.local_slice.start, shard.local_slice.stop
        self.num_local = stop - start
        down_data, down_trunc = down_index[0], down_index[1]
        keep = (down_data >= start) & (down_data < stop)  # A_down's columns of this rank's rows
        down = csr_pair(down_trunc[keep], down_data[keep] - start, down_weight[keep],
                        (self.num_truncation, self.num_local))
        up_trunc, up_data = up_index[0], up_index[1]
        keep = (up_data >= start) & (up_data < stop)  # A_up's rows of this rank's rows
        up = csr_pair(up_data[keep] - start, up_trunc[keep], up_weight[keep], (self.num_local, self.num_truncation))
        for prefix, pair in (("down", down), ("up", up)):
            for name, tensor in zip(_PAIR, pair, strict=True):
                self.register_buffer(f"{prefix}_{name}", tensor, persistent=False)

    def _pair(self, prefix: str) -> CsrPair:
        return CsrPair(*(getattr(self, f"{prefix}_{name}") for name in _PAIR))

    def forward(self, x: Tensor) -> Tensor:
        batch = x.shape[0]
        if x.dim() != 3 or x.shape[1] != self.num_local:
            raise ValueError(f"truncated residual input has shape {tuple(x.shape)}, expected (batch, grid_local="
                             f"{self.num_local}, vars)")
        rows = rearrange(x, "b g v -> g (b v)")
        partial = sparse_project(rows, self._pair("down"), (self.num_truncation, self.num_local))
        # summed over the group; each rank then reads the sum differently, so the backward sums the gradients
        coarse = copy_tensor(reduce_tensor(partial, self.shard.group), self.shard.group)
        fine = sparse_project(coarse, self._pair("up"), (self.num_local, self.num_truncation))
        return rearrange(fine, "g (b v) -> b g v", b=batch)

    def extra_repr(self) -> str:
        return f"truncation={self.num_truncation}, grid_local={self.num_local}, world={self.shard.world}"
