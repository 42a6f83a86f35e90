"""``HeteroGraph``: the container of a model's graph, nodes and edges by type, in plain torch.

It has the part of ``torch_geometric.data.HeteroData``'s interface that stormshard uses:

- ``graph["data"]`` / ``graph["hidden"]``: a node store (``x``, ``area_weight``; ``num_nodes`` is
  ``x``'s row count unless set);
- ``graph[("data", "to", "hidden")]``: an edge store (``edge_index`` ``(2, E)``, ``edge_attr``;
  ``num_edges``);
- stores take attributes and items alike (``store.x`` is ``store["x"]``), ``keys()`` lists them;
- ``node_types``, ``edge_types`` (in insertion order), graph-level attributes (``graph.config_hash``),
  and :meth:`HeteroGraph.validate` (edge indices inside their node sets).

Importing torch-geometric costs ~130 MiB of resident memory per process (it loads pandas and
torch._dynamo); a training or inference rank only reads tensors from its graph, so the graph is this
plain container. torch-geometric stays an optional dependency of the reference layers and tests.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor

__all__ = ["HeteroGraph", "GraphStore"]

EdgeType = tuple[str, str, str]


class GraphStore:
    """The tensors of one node or edge type: attribute and item access, ``keys()``."""

    def __init__(self, key: str | EdgeType) -> None:
        object.__setattr__(self, "_key", key)
        object.__setattr__(self, "_data", {})

    def __getattr__(self, name: str) -> Any:
        data = object.__getattribute__(self, "_data")
        if name in data:
            return data[name]
        if name == "num_nodes" and "x" in data:
            return int(data["x"].shape[0])
        if name == "num_edges" and "edge_index" in data:
            return int(data["edge_index"].shape[1])
        raise AttributeError(f"graph store {self._key!r} has no {name!r} (it holds {sorted(data)})")

    def __setattr__(self, name: str, value: Any) -> None:
        self._data[name] = value

    def __getitem__(self, name: str) -> Any:
        return getattr(self, name)

    def __setitem__(self, name: str, value: Any) -> None:
        self._data[name] = value

    def __contains__(self, name: str) -> bool:
        return name in self._data

    def keys(self) -> list[str]:
        return list(self._data)

    def items(self) -> list[tuple[str, Any]]:
        return list(self._data.items())

    def __repr__(self) -> str:
        shapes = {k: tuple(v.shape) if isinstance(v, Tensor) else v for k, v in self._data.items()}
        return f"GraphStore({self._key!r}, {shapes})"


class HeteroGraph:
    """Node stores keyed by type name, edge stores keyed by ``(source, relation, destination)``, and
    graph-level attributes. A store is created on first access (``graph["data"].x = ...``)."""

    def __init__(self) -> None:
        object.__setattr__(self, "_stores", {})
        object.__setattr__(self, "_attrs", {})

    def __getitem__(self, key: str | EdgeType) -> GraphStore:
        if not (isinstance(key, str) or (isinstance(key, tuple) and len(key) == 3 and all(isinstance(k, str) for k in key))):
            raise KeyError(f"a graph store is keyed by a node type (str) or an edge type (src, rel, dst), got {key!r}")
        stores = self._stores
        if key not in stores:
            stores[key] = GraphStore(key)
        return stores[key]

    def __contains__(self, key: str | EdgeType) -> bool:
        return key in self._stores

    def __getattr__(self, name: str) -> Any:
        attrs = object.__getattribute__(self, "_attrs")
        if name in attrs:
            return attrs[name]
        raise AttributeError(f"the graph has no attribute {name!r} (it has {sorted(attrs)})")

    def __setattr__(self, name: str, value: Any) -> None:
        self._attrs[name] = value

    @property
    def node_types(self) -> list[str]:
        return [k for k in self._stores if isinstance(k, str)]

    @property
    def edge_types(self) -> list[EdgeType]:
        return [k for k in self._stores if isinstance(k, tuple)]

    def stores(self) -> Iterator[tuple[str | EdgeType, GraphStore]]:
        return iter(self._stores.items())

    def validate(self, raise_on_error: bool = True) -> bool:
        """Whether every edge type's ``edge_index`` is ``(2, E)`` integer with sources and destinations
        inside their node sets, and its ``edge_attr`` (if any) has ``E`` rows. Raises ``ValueError``
        naming the edge type and the problem when ``raise_on_error``."""
        problems = []
        for et in self.edge_types:
            store, (src, _, dst) = self[et], et
            if "edge_index" not in store:
                problems.append(f"{et}: no edge_index")
                continue
            ei = store.edge_index
            if ei.dim() != 2 or ei.shape[0] != 2 or ei.is_floating_point():
                problems.append(f"{et}: edge_index must be an integer (2, E) tensor, got {ei.dtype} {tuple(ei.shape)}")
                continue
            for row, node_type in ((0, src), (1, dst)):
                if node_type not in self._stores:
                    problems.append(f"{et}: node type {node_type!r} has no store")
                elif ei.shape[1] and (int(ei[row].min()) < 0 or int(ei[row].max()) >= self[node_type].num_nodes):
                    problems.append(f"{et}: edge_index row {row} leaves [0, {self[node_type].num_nodes}) of {node_type!r}")
            if "edge_attr" in store and store.edge_attr.shape[0] != ei.shape[1]:
                problems.append(f"{et}: edge_attr has {store.edge_attr.shape[0]} rows for {ei.shape[1]} edges")
        if problems and raise_on_error:
            raise ValueError("invalid graph: " + "; ".join(problems))
        return not problems

    def __repr__(self) -> str:
        return f"HeteroGraph(nodes={self.node_types}, edges={self.edge_types}, attrs={sorted(self._attrs)})"
