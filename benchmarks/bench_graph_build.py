"""Time building the encoder-processor-decoder graph, and loading it back from its cache file.

    python benchmarks/bench_graph_build.py            # O96 data, icosahedral levels 5 and 6
    python benchmarks/bench_graph_build.py --quick    # O48 data, icosahedral level 4

Prints per-stage build times, edge counts, coverage edges added, file size, and the ratio of a cached
load to a build (the baseline, measured in the same run).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from stormshard.graphs.attributes import area_weights
from stormshard.graphs.builder import GraphConfig, build_graph, load_or_build_graph
from stormshard.graphs.grids import grid_from_name
from stormshard.graphs.icosahedral import icosahedral_mesh, multimesh_edges


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="O48 -> ico4 only")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    cases = [("o48", "ico4")] if args.quick else [("o96", "ico5"), ("o96", "ico6")]
    print("shared 2-core CPU machine; times are the best of", args.repeats, "runs")
    for data, hidden in cases:
        cfg = GraphConfig(data_grid=data, hidden=hidden)
        level = cfg.icosahedral_level
        lat, lon = grid_from_name(data)
        t_mesh = _best(lambda: multimesh_edges(icosahedral_mesh(level)), args.repeats)  # noqa: B023
        t_area = _best(lambda: area_weights(np.radians(lat), np.radians(lon)), args.repeats)  # noqa: B023
        t_build = _best(lambda: build_graph(cfg), args.repeats)  # noqa: B023
        graph = build_graph(cfg)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "graph.pt"
            load_or_build_graph(cfg, path)
            t_load = _best(lambda: load_or_build_graph(cfg, path), args.repeats)  # noqa: B023
            size = path.stat().st_size
        edges = {"->".join((s, d)): graph[(s, r, d)].edge_index.shape[1] for s, r, d in graph.edge_types}
        print(
            f"{data} -> {hidden}: data {graph['data'].num_nodes:,} hidden {graph['hidden'].num_nodes:,} nodes; "
            f"edges {edges}; coverage edges added {graph.coverage_edges}"
        )
        print(
            f"  build {t_build:.2f} s (mesh+multimesh {t_mesh:.2f} s, data area weights {t_area:.2f} s); "
            f"cached load {t_load:.3f} s = {t_load / t_build:.3f} x build; file {size / 1e6:.1f} MB"
        )


if __name__ == "__main__":
    main()
