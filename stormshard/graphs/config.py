"""What the encoder-processor-decoder graph is built from (the ``graph`` section of an experiment
config): the data grid, the hidden mesh or grid, and the encoder / processor / decoder edges.

Torch-free (pydantic and the grid names only), so that an experiment config validates before torch is
imported; :mod:`stormshard.graphs.builder` builds the graph and re-exports these names.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from stormshard.graphs.grids import grid_from_name

__all__ = ["KNNEdges", "CutoffEdges", "MultimeshEdges", "MapperEdges", "ProcessorEdges", "TruncationGrid", "GraphConfig"]

ICOSAHEDRAL_NAME = re.compile(r"ico(\d+)")


class KNNEdges(BaseModel):
    """Every destination node receives from its ``num_neighbours`` nearest source nodes."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["knn"] = "knn"
    num_neighbours: int = Field(3, ge=1)


class CutoffEdges(BaseModel):
    """Every destination receives from all sources within ``factor`` * (largest nearest-neighbour
    distance among the destination nodes); AIFS uses 0.6 for the encoder."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["cutoff"] = "cutoff"
    factor: float = Field(0.6, gt=0)


class MultimeshEdges(BaseModel):
    """The union of the triangle edges of every icosahedral refinement level (icosahedral hidden only)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: Literal["multimesh"] = "multimesh"


MapperEdges = Annotated[KNNEdges | CutoffEdges, Field(discriminator="kind")]
ProcessorEdges = Annotated[MultimeshEdges | KNNEdges, Field(discriminator="kind")]


class TruncationGrid(BaseModel):
    """A coarser grid for a truncated residual (``model.residual: "truncated"``; anemoi's ``TruncatedConnection``
    built on the fly): ``truncation`` nodes on ``grid``, each receiving from its ``num_neighbours`` nearest data
    nodes (the down projection), and every data node from its ``num_neighbours`` nearest truncation nodes (the up
    projection), weighted ``exp(-d^2 / (2 sigma^2))`` (``d``: great-circle distance in radians) and normalised to
    sum to 1 over each destination node, as anemoi-graphs' ``GaussianDistanceWeights`` with its default l1 norm."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    grid: str
    num_neighbours: int = Field(3, ge=1)
    sigma: float = Field(1.0, gt=0)

    @field_validator("grid")
    @classmethod
    def _check_grid(cls, value: str) -> str:
        try:
            grid_from_name(value)
        except ValueError as err:
            raise ValueError(f"truncation.grid={value!r} is not a grid name ({err}); name a grid such as 'o32'"
                             ) from None
        return value


class GraphConfig(BaseModel):
    """What the encoder-processor-decoder graph is built from.

    ``data_grid``: a grid name (``"o96"``, ``"1.0"``, see ``grid_from_name``), or None when the data
    coordinates are passed to ``build_graph`` (a dataset's own lat/lon, possibly a limited area).
    ``hidden``: ``"ico<r>"`` (refined icosahedral mesh, 10 * 4**r + 2 nodes) or a grid name (``"o48"``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)
    data_grid: str | None = None
    hidden: str = "ico5"
    encoder: MapperEdges = CutoffEdges(factor=0.6)
    processor: ProcessorEdges = MultimeshEdges()
    decoder: MapperEdges = KNNEdges(num_neighbours=3)
    area_clip_factor: float | None = Field(4.0, gt=1)
    truncation: TruncationGrid | None = None

    @field_validator("data_grid")
    @classmethod
    def _check_data_grid(cls, value: str | None) -> str | None:
        if value is not None:
            grid_from_name(value)  # raises a ValueError naming the accepted forms
        return value

    @field_validator("hidden")
    @classmethod
    def _check_hidden(cls, value: str) -> str:
        m = ICOSAHEDRAL_NAME.fullmatch(value.strip().lower())
        if m:
            level = int(m.group(1))
            if level > 8:
                raise ValueError(
                    f"hidden={value!r}: icosahedral levels above 8 (2.6M nodes) are not supported"
                )
            return f"ico{level}"
        try:
            grid_from_name(value)
        except ValueError:
            raise ValueError(
                f"hidden={value!r} is neither 'ico<r>' (icosahedral mesh of level r, e.g. 'ico5') nor a grid "
                "name ('o48', '2.0')"
            ) from None
        return value

    @model_validator(mode="after")
    def _check_processor(self) -> GraphConfig:
        if isinstance(self.processor, MultimeshEdges) and not self.hidden.startswith("ico"):
            raise ValueError(
                f"processor multimesh edges need an icosahedral hidden mesh, but hidden={self.hidden!r}; "
                "use hidden='ico<r>' or processor={'kind': 'knn', 'num_neighbours': ...}"
            )
        return self

    @property
    def icosahedral_level(self) -> int | None:
        m = ICOSAHEDRAL_NAME.fullmatch(self.hidden)
        return int(m.group(1)) if m else None
