"""stormshard against anemoi-models 0.19 on one GPU, same model and same weights: whole step and graph attention.

    python benchmarks/bench_gpu_vs_anemoi.py [--quick] [--budget-s S] [--json PATH]   # CUDA (make bench-gpu)
        [--anemoi-python PY] [--anemoi-pythonpath DIRS] [--tables model:o96,attention:aifs,model:aifs]
        [--triton-tiles HPxBLOCK_ExWARPS[xNODES],...]   # with --tables ...,tiles:aifs
        [--cuda-graphs o96,...]   # the sizes with a "compiled + CUDA graphs" row (default o96)
        [--selective aifs,...]   # the checkpointed sizes with a "compiled, selective checkpointing + encoder" row (default aifs)
        [--memory-census]   # what is alive at each stormshard row's peak, by source line (CUDA)
    python benchmarks/bench_gpu_vs_anemoi.py --cpu-smoke      # tiny grids on the CPU: every code path, fp32

Without CUDA (and without ``--cpu-smoke``) it says so and exits 0.

**Whole-model table** at two sizes, batch 1, ``multistep_input`` 2, ``trainable_size`` 8, a
``transformer`` model (graph-transformer encoder and decoder, sliding-window transformer processor):

- ``o96``: O96 data (40,320 points) -> O48 hidden (10,944), 512 channels, 16 layers, 16 heads, window 512,
  64 variables, no activation checkpointing;
- ``aifs``: O364 data (543,088 points, the O-grid nearest N320) -> O96 hidden (40,320), 1024 channels,
  16 layers, 16 heads, window 1120, 96 variables, activation checkpointing of every processor block.

Encoder edges: cutoff 0.6 (AIFS's), decoder: 3 nearest hidden nodes. One training step: forward under
bf16 autocast, fp32 MSE loss, backward, AdamW (stormshard's: what its training builds,
:func:`~stormshard.training.engine.adamw.build_adamw`, torch's fused kernel on CUDA; anemoi's:
``torch.optim.AdamW`` with torch's defaults, as anemoi-training builds it). Rows: stormshard with its default settings
(``graph_kernel`` and ``attention_kernel`` "auto": the Triton graph kernel and flex / flash window attention
on CUDA) eager and compiled (``training.compile``: :func:`stormshard.models.compile.compile_blocks`), at the
sizes of ``--selective`` (checkpointed ones) compiled with ``model.activation_checkpointing: "selective"`` and
the encoder checkpointed (``model.encoder.activation_checkpointing: "selective"``) too (the attention outputs
kept for the backward: the recompute runs no flex forward; the encoder's keys and values on the data nodes
remade in its own backward; anemoi keeps the matched checkpointing), and
anemoi-models' own model built from the same weights (:mod:`stormshard.checkpoint.anemoi_plan` +
:func:`~stormshard.checkpoint.anemoi_build.build_anemoi_interface`, as ``export-anemoi`` does) in anemoi's
interpreter (``benchmarks/anemoi_side/gpu_vs_stormshard.py``, a subprocess: ``--anemoi-python`` /
``$ANEMOI_PY`` and ``--anemoi-pythonpath`` / ``$ANEMOI_PYTHONPATH``, as ``bench_graph_vs_anemoi.py``).
anemoi runs its GPU defaults: ``graph_attention_backend: "triton"`` and ``attention_implementation:
"flash_attention"`` when flash-attn imports, else ``"scaled_dot_product_attention"`` (a dense band mask); the
table says which ran. Checkpointing is the same on both sides (``aifs``: every processor block, anemoi's
processor ``num_chunks`` = layers; mappers in one chunk, not checkpointed). Before timing, the anemoi side
checks both models' fp32 forward on one random state (TF32 off) and prints the largest difference relative
to the largest predicted increment (output minus the carried state).

Columns: **step ms**, the median of the timed steps after warm-up (``time.perf_counter`` between device
syncs); **peak GiB**, ``torch.cuda.max_memory_allocated`` over the steps (weights, AdamW state and
activations); **GPU busy**, the fraction of the step in which the GPU runs anything: one more step under
``torch.profiler`` (CPU + CUDA activities), the union of the intervals of its device events (kernels,
copies, memsets; sync waits excluded) divided by the median step time of the unprofiled steps (the
profiler's host overhead does not enter; at most 1); **TFLOP/s** and **MFU**, the model FLOPs below over the
median step, MFU over the device's bf16 dense peak (``bench_gpu.device_peak``, else the measured 8192^3 rate).

**Model FLOPs** (:func:`model_flops`; batch 1; ``N_d`` data, ``N_h`` hidden nodes, ``C`` channels,
``E_enc`` / ``E_dec`` edges with ``F_enc`` / ``F_dec`` features, ``n_in`` / ``n_out`` variables, ``m``
input steps, ``t`` trainable node features, ``r`` MLP ratios, ``L`` layers, ``w`` the window)::

    linear(N, a, b)  = 2 N a b                                       every dense product of a Linear
    embeddings       = linear(N_d, m n_in + 4 + t, C) + linear(N_h, 4 + t, C)   (+ the decoder's own, if any)
    mapper(src, dst) = linear(src, C, 2C) [k, v] + linear(dst, C, C) x (2 + self_projection) [q, out]
                       + 2 linear(dst, C, r C) [MLP]
                       + 2 E F C [edge embedding, per edge] + 4 E C [graph attention: q.k 2d, sum a v 2d, per head]
    processor        = L (linear(N_h, C, 3C) + linear(N_h, C, C) + 2 linear(N_h, C, r C))
                       + L 4 C P,  P = sum_i #{j : |i - j| <= w} = N_h (2w + 1) - w (w + 1) (w < N_h)
    head             = linear(N_d, C, n_out)
    step             = 3 x forward (forward + backward), activation recomputation NOT counted (model FLOPs)

The edge embedding counts as a per-edge product (the model's math, as anemoi computes it); stormshard
keeps it factored and executes fewer FLOPs there. Both sides get the same count, so MFU ratios are
speed ratios. ``tests/test_bench_gpu_vs_anemoi.py`` checks the linear part against the dense products a
forward really runs and the window pairs against a brute-force count.

**Graph-attention table** (``--tables attention:aifs``): the three graphs of the ``aifs`` size, encoder
O364 -> O96 (cutoff 0.6), processor O96 KNN-16, decoder O96 -> O364 (3 nearest), 1024 channels, 16 heads,
bf16 q, k, v ``(nodes, heads, 64)``, fp32 edge attributes ``(E, 3)`` and edge projection ``(C, 3)`` + bias:
one block's attention forward + backward (gradients of q, k, v and the edge projection). stormshard:
:func:`stormshard.kernels.dispatch.graph_attention_kernel` with ``"triton"`` and ``"csr"`` (the edge term
factored, never per edge). anemoi: as its block with ``graph_attention_backend: "triton"`` does it: the
edge projection ``lin_edge(edge_attr)`` to ``(E, heads, 64)``, ``edge_index_to_csc`` and its Triton
custom op. Time: median fwd + bwd; memory: peak above what the inputs hold.

**Tile table** (``--tables tiles:aifs --triton-tiles 16x8x8,2x8x4,...``): the same graphs, stormshard's
Triton kernel at :func:`~stormshard.kernels.graph_triton.tile_config`'s tiles and at each launch
configuration given (heads per program x edges per tile x warps,
:func:`stormshard.kernels.graph_triton.tile_override`), measured side by side: the timed sweep behind
the tile choice (``benchmarks/triton_registers.py`` reports their registers without a GPU).

``--cpu-smoke``: tiny grids (model: O16 -> O8, O12 -> O6; attention: O4 -> O2), fp32, a few steps on the CPU, compiled rows with
``STORMSHARD_COMPILE_BACKEND=aot_eager`` unless set; with ``TRITON_INTERPRET=1`` the Triton rows (both
libraries') run in Triton's interpreter. anemoi rows run when its interpreter imports anemoi-models; if not,
the script says how to get it and runs stormshard's rows only. ``--tables`` runs the tables in the order
given (default ``model:o96,attention:aifs,model:aifs``: the most expensive rows, the AIFS-size model's, last);
``--budget-s`` starts no row after that many seconds (the rest print "skipped"; a row started runs to its
end); ``--json`` writes every row, the FLOP counts and the same-weights checks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "anemoi_side"))

from bench_gpu import device_peak, measured_bf16_rate, mse_training_step  # noqa: E402
from step_measure import (  # noqa: E402
    AttentionRow,
    ModelRow,
    attention_graphs,
    attention_inputs,
    finish_model_row,
    measure_attention,
    model_inputs,
)

from stormshard.graphs.builder import DECODER, ENCODER, GraphConfig, KNNEdges, load_or_build_graph  # noqa: E402
from stormshard.models.config import ModelConfig  # noqa: E402
from stormshard.models.variables import VariableIndex  # noqa: E402

ANEMOI_SIDE = HERE / "anemoi_side" / "gpu_vs_stormshard.py"
GRAPH_CACHE = REPO / ".cache" / "bench_gpu_vs_anemoi"
GET_ANEMOI = ("anemoi-models is not importable by {python}: anemoi rows skipped. On a CPU machine: bash "
              "../shared/anemoi-bench/setup_env.sh (then --anemoi-python /tmp/anemoi-env/venv/bin/python); for a GPU "
              "machine without an index: ../shared/gpu/fetch_anemoi_wheels.sh .whl here, carry .whl, and there "
              "`python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl` and pass "
              "--anemoi-python python3 --anemoi-pythonpath /tmp/site (benchmarks/gpu_session.sh does this)")


@dataclass(frozen=True)
class Size:
    """One whole-model size (module docstring); ``knn``: the processor graph of the attention table."""

    key: str
    data_grid: str
    hidden: str
    channels: int
    layers: int
    heads: int
    window: int
    checkpointing: bool
    variables: int
    forcing: int
    knn: int = 16

    @property
    def label(self) -> str:
        return (f"{self.data_grid.upper()} -> {self.hidden.upper()}, {self.channels} ch, {self.layers} layers, "
                f"window {self.window}{', checkpointing' if self.checkpointing else ''}")


SIZES = {
    "o96": Size("o96", "o96", "o48", 512, 16, 16, 512, False, 64, 2),
    "aifs": Size("aifs", "o364", "o96", 1024, 16, 16, 1120, True, 96, 4),
    "tiny": Size("tiny", "o16", "o8", 32, 2, 4, 16, False, 6, 1, knn=4),
    "tiny-ckpt": Size("tiny-ckpt", "o12", "o6", 32, 2, 4, 8, True, 5, 1, knn=4),
    "micro": Size("micro", "o4", "o2", 16, 1, 2, 8, False, 4, 1, knn=4),  # attention smoke: few Triton programs
}


def size_variables(size: Size) -> VariableIndex:
    names = [f"var_{i}" for i in range(size.variables)]
    return VariableIndex.build(names, forcing=names[-size.forcing:], diagnostic=[])


def size_config(size: Size) -> ModelConfig:
    """stormshard's model at ``size``: default kernels ("auto"), mappers in one chunk."""
    return ModelConfig(name="transformer", num_channels=size.channels, multistep_input=2, trainable_size=8,
                       processor=dict(num_layers=size.layers, num_heads=size.heads, window_size=size.window,
                                      mlp_ratio=4),
                       encoder=dict(num_heads=size.heads), decoder=dict(num_heads=size.heads),
                       activation_checkpointing=size.checkpointing)


def size_graph(size: Size) -> tuple[object, Path]:
    """The size's graph, built once and cached under ``.cache/bench_gpu_vs_anemoi``; and its file."""
    config = GraphConfig(data_grid=size.data_grid, hidden=size.hidden, processor=KNNEdges(num_neighbours=size.knn))
    path = GRAPH_CACHE / f"{size.data_grid}_{size.hidden}_knn{size.knn}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    return load_or_build_graph(config, path), path


# --------------------------------------------------------------------------------------------
# model FLOPs (module docstring)
# --------------------------------------------------------------------------------------------


def window_pairs(tokens: int, window: int) -> int:
    """Query-key pairs with ``|i - j| <= window`` among ``tokens`` positions."""
    if window >= tokens - 1:
        return tokens * tokens
    return tokens * (2 * window + 1) - window * (window + 1)


@dataclass
class ModelFlops:
    """Forward FLOPs of one batch entry by part; :attr:`step` = 3 x forward (no recomputation)."""

    linear: float = 0.0  # every dense product of a Linear (embeddings, q/k/v/out, MLPs, head)
    edge_projection: float = 0.0  # 2 E F C per mapper
    graph_attention: float = 0.0  # 4 E C per mapper
    window_attention: float = 0.0  # 4 C P per processor layer

    @property
    def forward(self) -> float:
        return self.linear + self.edge_projection + self.graph_attention + self.window_attention

    @property
    def step(self) -> float:
        return 3.0 * self.forward


def model_flops(config: ModelConfig, graph, variables: VariableIndex) -> ModelFlops:  # noqa: ANN001
    """:class:`ModelFlops` of a ``transformer`` model on ``graph`` (formula in the module docstring)."""
    if config.name != "transformer":
        raise ValueError(f"model_flops counts the 'transformer' model, got {config.name!r}")

    def linear(rows: int, a: int, b: int) -> float:
        return 2.0 * rows * a * b

    c, t, m = config.num_channels, config.trainable_size, config.multistep_input
    n_d, n_h = graph["data"].num_nodes, graph["hidden"].num_nodes
    n_in, n_out = len(variables.input_names), len(variables.output_names)
    f = ModelFlops()
    f.linear += linear(n_d, m * n_in + 4 + t, c) * (2 if config.decoder_embedding else 1) + linear(n_h, 4 + t, c)
    for section, edges, src, dst in (("encoder", ENCODER, n_d, n_h), ("decoder", DECODER, n_h, n_d)):
        cfg = getattr(config, section)
        e = int(graph[edges].edge_index.shape[1])
        feats = int(graph[edges].edge_attr.shape[1]) + cfg.trainable_edge_size
        hidden = max(1, int(round(c * cfg.mlp_ratio)))
        f.linear += linear(src, c, 2 * c) + linear(dst, c, c) * (2 + int(cfg.self_projection)) \
            + 2 * linear(dst, c, hidden)
        f.edge_projection += 2.0 * e * feats * c
        f.graph_attention += 4.0 * e * c
    p = config.processor
    f.linear += p.num_layers * (linear(n_h, c, 4 * c) + 2 * linear(n_h, c, p.mlp_ratio * c))
    f.window_attention += p.num_layers * 4.0 * c * window_pairs(n_h, p.window_size)
    f.linear += linear(n_d, c, n_out)
    return f


# --------------------------------------------------------------------------------------------
# whole-model rows
# --------------------------------------------------------------------------------------------


#: the implementation label's suffix of the rows compiled with ``training.cuda_graphs``
GRAPHED = "compiled + CUDA graphs"
#: the implementation label's suffix of the compiled rows with ``model.activation_checkpointing: "selective"`` and
#: the encoder checkpointed (``model.encoder.activation_checkpointing: "selective"``)
SELECTIVE = "compiled, selective checkpointing + encoder"


def run_stormshard_model(row: ModelRow, size: Size, graph, weights: dict, device: torch.device, warmup: int,  # noqa: ANN001
                         steps: int, flops: float, peak: float | None, dtype: torch.dtype,
                         memory_census: bool = False) -> None:
    from stormshard.models.compile import compile_blocks
    from stormshard.models.registry import build_model
    from stormshard.training.engine.adamw import build_adamw

    variables = size_variables(size)
    config = size_config(size)
    if row.impl.endswith(SELECTIVE):
        config = config.model_copy(update={"activation_checkpointing": "selective", "encoder": config.encoder.model_copy(
            update={"activation_checkpointing": "selective"})})
    model = build_model(config, graph, variables)
    model.load_state_dict(weights)
    model.to(device)
    graphed = row.impl.endswith(GRAPHED)
    if graphed and device.type != "cuda":
        row.note = "skipped: CUDA graphs need a CUDA device"
        return
    if "compiled" in row.impl:
        from torch import _dynamo

        _dynamo.reset()  # each compiled row compiles afresh (its compile time is its own)
        compile_blocks(model, cuda_graphs=graphed)
    optimizer = build_adamw(model.parameters(), lr=1e-4)  # what training builds: fused on CUDA
    x, target = model_inputs(graph, variables, device)

    step = mse_training_step(model, optimizer, x, target, None if dtype == torch.float32 else dtype,
                             mark_steps=graphed)
    finish_model_row(row, step, device, warmup, steps, flops, peak)
    if memory_census and device.type == "cuda":  # one more step under the allocator's history
        from memory_census import record_step_memory

        census = record_step_memory(step)
        row.extra["memory_census"] = census.table()
        row.extra["memory_sources"] = census.sources[:30]
    if graphed:  # the CUDA graph trees keep their memory pool until reset: not into the next row's memory
        from torch import _dynamo

        del step, optimizer, model
        _dynamo.reset()


# --------------------------------------------------------------------------------------------
# graph-attention rows
# --------------------------------------------------------------------------------------------


def run_stormshard_attention(row: AttentionRow, edge_index: torch.Tensor, num_src: int, num_dst: int, size: Size,
                             device: torch.device, dtype: torch.dtype, warmup: int, steps: int) -> None:
    from stormshard.kernels.dispatch import graph_attention_kernel
    from stormshard.kernels.graph_triton import tile_override

    kernel = row.impl.split()[1]  # "stormshard triton", "stormshard csr", "stormshard triton tiles HPxExW"
    index = edge_index.to(device)
    inputs = attention_inputs(num_src, num_dst, row.edges, size.channels, size.heads, 3, device, dtype)

    def forward() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            return graph_attention_kernel(kernel, inputs["q"], inputs["k"], inputs["v"], inputs["attr"],
                                          inputs["weight"], inputs["bias"], index, num_dst)

    if " tiles " in row.impl:
        with tile_override(parse_tiles(row.impl.split()[-1])):
            measure_attention(row, forward, inputs, device, warmup, steps)
    else:
        measure_attention(row, forward, inputs, device, warmup, steps)


def parse_tiles(text: str):  # noqa: ANN201 - a stormshard.kernels.graph_triton.Tiles
    """``"HPxBLOCK_ExWARPS"`` (e.g. ``4x8x8``) or ``"HPxBLOCK_ExWARPSxNODES"`` (nodes per program, e.g.
    ``4x4x4x4``) as :class:`~stormshard.kernels.graph_triton.Tiles`."""
    from stormshard.kernels.graph_triton import Tiles

    parts = text.lower().split("x")
    if len(parts) not in (3, 4) or not all(p.isdigit() for p in parts):
        raise ValueError(f"--triton-tiles {text!r}: write heads-per-program x edges-per-tile x warps [x nodes per "
                         "program], e.g. 4x8x8 or 4x4x4x4")
    return Tiles(*(int(p) for p in parts))


# --------------------------------------------------------------------------------------------
# the anemoi side (a subprocess in anemoi's interpreter)
# --------------------------------------------------------------------------------------------


def anemoi_env(args: argparse.Namespace) -> dict[str, str]:
    paths = [p for p in (args.anemoi_pythonpath, str(REPO)) if p]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(paths))


def anemoi_problem(args: argparse.Namespace) -> str | None:
    """None when ``--anemoi-python`` imports anemoi-models, torch-geometric, omegaconf and hydra; else why not."""
    if args.anemoi_python in ("", "none"):
        return "anemoi rows not asked for (--anemoi-python none)"
    probe = "import anemoi.models, anemoi.utils, torch_geometric, omegaconf, hydra; print(anemoi.models.__version__)"
    try:
        done = subprocess.run([args.anemoi_python, "-c", probe], env=anemoi_env(args), capture_output=True,
                              text=True, timeout=180)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{GET_ANEMOI.format(python=args.anemoi_python)} ({type(exc).__name__})"
    if done.returncode:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return f"{GET_ANEMOI.format(python=args.anemoi_python)} ({last})"
    return None


def run_anemoi(args: argparse.Namespace, job: dict, workdir: Path) -> dict:
    """Run the anemoi side on ``job`` (see gpu_vs_stormshard.py); its result dict, or {"error": ...}."""
    job_path, out_path = workdir / "job.json", workdir / "anemoi_result.json"
    job_path.write_text(json.dumps(job | {"out": str(out_path)}))
    timeout = None if math.isinf(args.budget_s) else max(600.0, job["budget_end"] - time.time() + 600)
    try:
        done = subprocess.run([args.anemoi_python, str(ANEMOI_SIDE), str(job_path)], env=anemoi_env(args),
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"the anemoi side ran past {timeout:.0f} s"}
    if not out_path.exists():
        return {"error": f"the anemoi side exited {done.returncode} without a result (its output is above)"}
    return json.loads(out_path.read_text())


# --------------------------------------------------------------------------------------------
# tables
# --------------------------------------------------------------------------------------------


def guarded(row: ModelRow | AttentionRow, run: Callable[[], None], budget_end: float) -> None:
    """``run()`` unless the budget is spent; an exception becomes the row's note (the other rows go on)."""
    if time.perf_counter() > budget_end:
        row.note = row.note or "skipped: --budget-s reached"
        return
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - a row that cannot run is reported, the others go on
        row.note = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    finally:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _num(value: float, fmt: str) -> str:
    return "-" if value is None or math.isnan(value) else format(value, fmt)


def format_model_row(r: ModelRow) -> str:
    impl = f"{r.impl} ({r.extra['attention']})" if r.extra.get("attention") else r.impl
    if r.note:
        return f"| {r.size} | {impl} | {r.note} | | | | | |"
    compile_s = _num(r.compile_s, ".1f") if "compiled" in r.impl else "-"
    busy = "-" if math.isnan(r.busy) else f"{100 * r.busy:.0f}%"
    mfu = "-" if math.isnan(r.mfu) else f"{100 * r.mfu:.1f}%"
    return (f"| {r.size} | {impl} | {r.step_ms:.1f} | {_num(r.peak_gib, '.2f')} | {busy} | {r.tflops:.3g} | {mfu} | "
            f"{compile_s} |")


def format_attention_row(r: AttentionRow, anemoi: AttentionRow | None) -> str:
    if r.note:
        return f"| {r.graph} | {r.edges:,} | {r.impl} | {r.note} | | | | |"
    ratio = (f"{anemoi.total_ms / r.total_ms:.2f}x" if anemoi is not None and not anemoi.note and r is not anemoi
             else "-")
    return (f"| {r.graph} | {r.edges:,} | {r.impl} | {r.fwd_ms:.2f} | {r.bwd_ms:.2f} | {r.total_ms:.2f} | "
            f"{_num(r.peak_mib, '.0f')} | {ratio} |")


def model_table(args: argparse.Namespace, key: str, device: torch.device, dtype: torch.dtype, peak: float | None,
                budget_end: float, workdir: Path, anemoi_ok: bool, report: dict) -> list[ModelRow]:
    """The whole-model rows of size ``key``: anemoi's (after the same-weights check), stormshard eager, compiled,
    and, for the sizes of ``--cuda-graphs``, compiled with CUDA graphs (``training.cuda_graphs``; CUDA only), for the
    checkpointed sizes of ``--selective``, compiled with selective checkpointing and the encoder checkpointed."""
    from stormshard.models.registry import build_model

    size, warmup, steps = SIZES[key], args.warmup, args.steps
    print(f"\nwhole model at {key} ({size.label}), one training step (forward "
          f"{'bf16 autocast' if dtype != torch.float32 else 'fp32'}, MSE, backward, AdamW), batch 1; median of {steps} "
          f"steps after {warmup}; MFU = 3 x forward model FLOPs (no recomputation) / step / peak", flush=True)
    ours = [ModelRow(key, "stormshard eager"), ModelRow(key, "stormshard compiled")]
    if key in args.cuda_graphs.split(","):
        ours.append(ModelRow(key, f"stormshard {GRAPHED}"))
    if key in args.selective.split(",") and size.checkpointing:
        ours.append(ModelRow(key, f"stormshard {SELECTIVE}"))
    theirs = ModelRow(key, "anemoi-models 0.19")
    if time.perf_counter() > budget_end:
        for r in [theirs, *ours]:
            r.note = "skipped: --budget-s reached"
            print(format_model_row(r), flush=True)
        return [theirs, *ours]
    tic = time.perf_counter()
    graph, graph_path = size_graph(size)
    variables, config = size_variables(size), size_config(size)
    flops = model_flops(config, graph, variables)
    torch.manual_seed(0)
    weights = {k: v.detach().clone() for k, v in build_model(config, graph, variables).state_dict().items()}
    weights_path = workdir / f"{key}_weights.pt"
    torch.save(weights, weights_path)
    report["flops"][key] = asdict(flops) | {"forward": flops.forward, "step": flops.step}
    print(f"{graph['data'].num_nodes:,} data / {graph['hidden'].num_nodes:,} hidden nodes, edges enc "
          f"{graph[ENCODER].edge_index.shape[1]:,} / dec {graph[DECODER].edge_index.shape[1]:,}; "
          f"{sum(w.numel() for w in weights.values()) / 1e6:.1f} M parameters; model GFLOPs per step "
          f"{flops.step / 1e9:.4g} (linear {3 * flops.linear / 1e9:.4g}, edge projection "
          f"{3 * flops.edge_projection / 1e9:.4g}, graph attention {3 * flops.graph_attention / 1e9:.4g}, "
          f"window attention {3 * flops.window_attention / 1e9:.4g}); graph + weights {time.perf_counter() - tic:.0f} s"
          "\n| size | implementation | step ms | peak GiB | GPU busy | TFLOP/s | MFU | compile s |\n"
          "|---|---|---|---|---|---|---|---|", flush=True)
    if anemoi_ok:
        job = {"task": "model", "size": asdict(size), "graph": str(graph_path), "weights": str(weights_path),
               "device": device.type, "dtype": str(dtype).removeprefix("torch."), "warmup": warmup, "steps": steps,
               "peak": peak, "flops": flops.step, "budget_end": time.time() + (budget_end - time.perf_counter())}
        result = run_anemoi(args, job, workdir)
        report["anemoi"][key] = result
        if "model" in result:
            theirs = ModelRow(**result["model"])
        else:
            theirs.note = f"error: {result.get('error', 'no result')}"
    else:
        theirs.note = "anemoi not available (see above)"
    print(format_model_row(theirs), flush=True)
    for row in ours:
        guarded(row, lambda row=row: run_stormshard_model(row, size, graph, weights, device, warmup, steps, flops.step,
                                                          peak, dtype, args.memory_census), budget_end)
        print(format_model_row(row), flush=True)
        if row.extra.get("memory_census"):
            print(f"{key}: {row.impl}: memory at the peak of one more step (benchmarks/memory_census.py):\n"
                  + row.extra["memory_census"], flush=True)
    weights_path.unlink(missing_ok=True)
    check = report["anemoi"].get(key, {}).get("check")
    if check and "error" in check:
        print(f"{key}: same weights, fp32 forward: the comparison failed ({check['error']})", flush=True)
    elif check:
        print(f"{key}: same weights, fp32 forward: max |anemoi - stormshard| = {check['max_abs']:.3g}, "
              f"{check['max_rel_increment']:.3g} of the largest increment, {check['max_rel_output']:.3g} of the "
              f"largest output", flush=True)
    for s in ours:
        if not s.note and not theirs.note:
            a = theirs
            print(f"{key}: {s.impl} vs anemoi: {a.step_ms / s.step_ms:.2f}x faster (anemoi ms / stormshard ms), peak "
                  f"memory {_num(s.peak_gib / a.peak_gib, '.2f')}x of anemoi's, GPU busy {_num(100 * s.busy, '.0f')}% "
                  f"vs {_num(100 * a.busy, '.0f')}%, MFU {_num(100 * s.mfu, '.1f')}% vs {_num(100 * a.mfu, '.1f')}%",
                  flush=True)
    compiled = next((r for r in ours if r.impl == "stormshard compiled" and not r.note), None)
    for s in ours:
        if compiled is not None and s.impl != compiled.impl and s.impl.startswith("stormshard compiled") and not s.note:
            print(f"{key}: {s.impl} vs compiled (the defaults): {compiled.step_ms / s.step_ms:.2f}x faster, peak "
                  f"{_num(s.peak_gib, '.2f')} vs {_num(compiled.peak_gib, '.2f')} GiB, loss {s.loss:.6g} vs "
                  f"{compiled.loss:.6g}", flush=True)
    return [theirs, *ours]


def attention_table(args: argparse.Namespace, key: str, device: torch.device, dtype: torch.dtype, budget_end: float,
                    workdir: Path, anemoi_ok: bool, report: dict, tiles: bool = False) -> list[AttentionRow]:
    """The graph-attention rows on the graphs of size ``key``: anemoi's Triton kernel, stormshard's triton and csr;
    with ``tiles`` (the ``tiles:SIZE`` table) stormshard's triton at its own tiles and at each of ``--triton-tiles``."""
    from stormshard.kernels.dispatch import graph_kernel_problem

    anemoi_ok = anemoi_ok and not tiles
    kernels = ["triton", *(f"triton tiles {t}" for t in args.triton_tiles.split(",") if t)] if tiles \
        else ["triton", "csr"]
    size = SIZES[key]
    graph, graph_path = size_graph(size)
    print(f"\n{'tile table: stormshard triton at other tiles; ' if tiles else ''}graph attention of one block, forward + backward ({'bf16' if dtype != torch.float32 else 'fp32'} "
          f"q/k/v, {size.channels} channels, {size.heads} heads, 3 edge features), graphs of {size.key}: encoder "
          f"{size.data_grid.upper()} -> {size.hidden.upper()} (cutoff 0.6), processor {size.hidden.upper()} "
          f"KNN-{size.knn}, decoder {size.hidden.upper()} -> {size.data_grid.upper()} (3 nearest); median of "
          f"{args.steps} after {args.warmup}; memory: peak above the inputs\n| graph | edges | implementation | "
          "fwd ms | bwd ms | fwd+bwd ms | peak MiB | anemoi / this |\n|---|---|---|---|---|---|---|---|", flush=True)
    anemoi_rows: dict[str, AttentionRow] = {}
    if anemoi_ok:
        job = {"task": "attention", "size": asdict(size), "graph": str(graph_path), "device": device.type,
               "dtype": str(dtype).removeprefix("torch."), "warmup": args.warmup, "steps": args.steps,
               "budget_end": time.time() + (budget_end - time.perf_counter())}
        result = run_anemoi(args, job, workdir)
        report["anemoi"][f"attention:{key}"] = result
        for r in result.get("attention", []):
            anemoi_rows[r["graph"]] = AttentionRow(**r)
    rows: list[AttentionRow] = []
    for name, edge_index, num_src, num_dst in attention_graphs(graph):
        theirs = anemoi_rows.get(name) or AttentionRow(name, "anemoi triton", int(edge_index.shape[1]),
                                                      note="anemoi not available" if not anemoi_ok else "no result")
        if not tiles:
            print(format_attention_row(theirs, theirs), flush=True)
        for kernel in kernels:
            row = AttentionRow(name, f"stormshard {kernel}", int(edge_index.shape[1]))
            problem = graph_kernel_problem(kernel.split()[0], device.type)
            if problem:
                row.note = f"skipped: {problem}"
            else:
                guarded(row, lambda row=row, e=edge_index, s=num_src, d=num_dst: run_stormshard_attention(
                    row, e, s, d, size, device, dtype, args.warmup, args.steps), budget_end)
            print(format_attention_row(row, theirs), flush=True)
            rows.append(row)
        if not tiles:
            rows.append(theirs)
    print()
    for row in rows:
        theirs = anemoi_rows.get(row.graph)
        if row.impl.startswith("stormshard") and row.probes and theirs is not None and theirs.probes:
            print(f"{row.graph}: {row.impl} vs anemoi triton, same seeded inputs: <out, grad>, <dq, q>, <dk, k>, "
                  f"<dv, v>, <dW_edge, W_edge> differ by {probe_difference(row.probes, theirs.probes):.2g} relative; "
                  f"fwd+bwd {theirs.total_ms / row.total_ms:.2f}x faster"
                  + ("" if math.isnan(row.peak_mib) else f", peak memory {row.peak_mib / theirs.peak_mib:.2f}x of "
                     "anemoi's"), flush=True)
    return rows


def probe_difference(ours: list[float], theirs: list[float]) -> float:
    """The largest relative difference between two :attr:`AttentionRow.probes` lists."""
    return max(abs(a - b) / max(abs(a), abs(b), 1e-30) for a, b in zip(ours, theirs, strict=True))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer steps (1 warm-up, 3 timed)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny grids on the CPU, fp32: every code path")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="start no row after this many seconds")
    parser.add_argument("--json", default=None, help="write the rows, FLOP counts and checks to this path")
    parser.add_argument("--tables", default=None, help="tables in order, a comma list of model:SIZE and "
                        "attention:SIZE (SIZE one of " + ", ".join(SIZES) + "; default model:o96,attention:aifs,"
                        "model:aifs, and model:tiny,model:tiny-ckpt,attention:micro with --cpu-smoke)")
    parser.add_argument("--triton-tiles", default="",
                        help="the tile table's launch configurations of the Triton graph kernel (--tables tiles:SIZE), "
                             "a comma list of HPxBLOCK_ExWARPS[xNODES] (heads per program x edges per tile x warps "
                             "[x nodes per program]), e.g. 16x8x8,8x8x8,4x4x4x4")
    parser.add_argument("--cuda-graphs", default="o96",
                        help="the sizes (a comma list) whose whole-model table has the 'compiled + CUDA graphs' row "
                             "(training.cuda_graphs; default o96, the host-bound size: at the AIFS size the row costs "
                             "another compile of a minute or two)")
    parser.add_argument("--selective", default="aifs",
                        help="the checkpointed sizes (a comma list) whose whole-model table has the 'compiled, "
                             "selective checkpointing + encoder' row (model.activation_checkpointing and "
                             "model.encoder.activation_checkpointing 'selective'; default aifs)")
    parser.add_argument("--memory-census", action="store_true",
                        help="after each stormshard whole-model row, one more step under the CUDA allocator's history: "
                             "what is alive at the peak, by source line (benchmarks/memory_census.py)")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--anemoi-python", default=os.environ.get("ANEMOI_PY", "/tmp/anemoi-env/venv/bin/python"),
                        help="anemoi's interpreter ('none': stormshard's rows only)")
    parser.add_argument("--anemoi-pythonpath", default=os.environ.get("ANEMOI_PYTHONPATH", ""),
                        help="prepended to PYTHONPATH for anemoi's interpreter (the checkout is appended)")
    args = parser.parse_args(argv)
    if not args.cpu_smoke and not torch.cuda.is_available():
        print("bench_gpu_vs_anemoi: no CUDA device here; the GPU head-to-head needs one (--cpu-smoke runs the code "
              "paths at tiny sizes on the CPU)")
        return 0
    smoke = args.cpu_smoke
    args.tables = args.tables or ("model:tiny,model:tiny-ckpt,attention:micro" if smoke else
                                  "model:o96,attention:aifs,model:aifs")
    tables = [item.partition(":")[::2] for item in args.tables.split(",")]
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick or smoke else 2)
    args.steps = args.steps if args.steps is not None else (2 if smoke else 3 if args.quick else 5)
    for text in filter(None, args.triton_tiles.split(",")):
        try:
            parse_tiles(text)
        except ValueError as err:
            parser.error(str(err))
    unknown = [f"{t}:{k}" for t, k in tables if t not in ("model", "attention", "tiles") or k not in SIZES]
    if unknown:
        parser.error(f"--tables {unknown}: use model:SIZE, attention:SIZE or tiles:SIZE with SIZE one of "
                     f"{', '.join(SIZES)}")
    if any(t == "tiles" for t, _ in tables) and not args.triton_tiles:
        parser.error("--tables tiles:SIZE times --triton-tiles: give them (e.g. --triton-tiles 16x8x8,2x8x4)")
    budget_end = time.perf_counter() + args.budget_s
    if smoke:
        device, dtype, peak = torch.device("cpu"), torch.float32, None
        os.environ.setdefault("STORMSHARD_COMPILE_BACKEND", "aot_eager")
        print(f"CPU smoke: torch {torch.__version__}, {torch.get_num_threads()} threads, fp32, compile backend "
              f"{os.environ['STORMSHARD_COMPILE_BACKEND']}, TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET', '0')}")
    else:
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
        name = torch.cuda.get_device_name(device)
        spec, rate = device_peak(name), measured_bf16_rate(device)
        peak = spec or rate
        print(f"device: {name}; torch {torch.__version__}; bf16 dense peak {_num((spec or math.nan) / 1e12, '.0f')} "
              f"TFLOP/s (spec), measured 8192^3 bf16 product {rate / 1e12:.0f} TFLOP/s", flush=True)
    problem = anemoi_problem(args)
    print(problem or f"anemoi side: {args.anemoi_python} (PYTHONPATH {anemoi_env(args)['PYTHONPATH']})", flush=True)
    report: dict = {"device": str(device), "torch": torch.__version__, "flops": {}, "anemoi": {}}
    model_rows: list[ModelRow] = []
    attention_rows: list[AttentionRow] = []
    with tempfile.TemporaryDirectory(prefix="bench-gpu-vs-anemoi-") as tmp:
        for table, key in tables:
            if table == "model":
                model_rows += model_table(args, key, device, dtype, peak, budget_end, Path(tmp), problem is None, report)
            else:
                attention_rows += attention_table(args, key, device, dtype, budget_end, Path(tmp), problem is None,
                                                  report, tiles=table == "tiles")
    if args.json:
        report |= {"model_rows": [asdict(r) for r in model_rows], "attention_rows": [asdict(r) for r in attention_rows]}
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
