"""GPU kernels against the limit: attention kernel x precision x compile, step time, memory and MFU.

    python benchmarks/bench_gpu.py             # CUDA: the AIFS processor and the O96 -> O48 model (make bench-gpu)
    python benchmarks/bench_gpu.py --quick     # CUDA: fewer layers and steps; without CUDA: the CPU mode, small
    python benchmarks/bench_gpu.py --cpu       # the CPU mode (small shapes) on any machine

**GPU mode** (one CUDA device), two tables:

1. the sliding-window transformer processor at the AIFS shape: the O96 hidden grid (40,320 nodes),
   1024 channels, 16 heads, window 1120, batch 1, ``--layers`` blocks (default 4; MFU is per block),
   forward + backward (no optimizer), without activation checkpointing;
2. the whole model, O96 data -> O48 hidden, 512 channels, 8 layers, window 512, activation
   checkpointing, forward + fp32 MSE loss + backward + AdamW (what ``bench_precision.py`` measured).

Rows: precision fp32 (TF32 off) / bf16 (autocast), attention kernel banded / flex / flash (when
flash-attn is importable), ``training.compile`` off / on. Each row: median step time after warm-up
(the compile is timed apart, in the first step), peak device memory, achieved TFLOP/s and model
FLOPs utilisation: the processor's dense products (``24 N C^2`` per block forward) and window
attention (``4 N (2w + 1) C`` per block forward, the attended entries only), times 3 for forward +
backward, over the device's bf16 dense peak (spec sheet; the measured rate of an 8192^3 bf16
product is printed beside it). The whole model's MFU counts its processor FLOPs only (a lower bound).
Then bf16 vs fp32 and flex vs banded ratios.

Before those, the **flex options** table (``--tables flex``) times flex attention alone at the AIFS
attention shape (batch 1, 16 heads, 40,320 tokens, head dim 64, window 1120, bf16), forward and
backward apart, for torch's default Triton tiles and a few candidate ``kernel_options``
(:func:`stormshard.kernels.flex.set_flex_kernel_options`), each checked against the default's
output and gradient. The fastest forward and backward options, where they beat the default by more
than 2%, are merged into the "tuned" options, and the processor's compiled flex row is run again with them.

**CPU mode** (small shapes): flex vs banded forward of the window kernel (``no_grad``, what a CPU
forecast runs; the flex compile timed apart), and compile vs eager for a training step of a small
transformer model (compile time included as its own column).

``--budget-s`` stops starting new rows once that many seconds have passed (the rest print
"skipped"), so a lease-limited GPU run ends in time. ``--json PATH`` writes the rows.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stormshard.graphs.builder import GraphConfig, KNNEdges, build_graph  # noqa: E402
from stormshard.kernels.dispatch import sliding_window_attention  # noqa: E402
from stormshard.kernels.flash import flash_attn_window_func  # noqa: E402
from stormshard.kernels.flex import TUNED_KERNEL_OPTIONS, flex_attention_unavailable  # noqa: E402
from stormshard.models.config import ModelConfig  # noqa: E402
from stormshard.models.parallelize import build_transformer_processor  # noqa: E402
from stormshard.models.registry import build_model  # noqa: E402
from stormshard.models.variables import VariableIndex  # noqa: E402
from stormshard.training.engine.adamw import build_adamw  # noqa: E402

# bf16 dense tensor-core peak, FLOP/s, from the vendors' spec sheets (no sparsity)
BF16_PEAK = {"H100 PCIe": 756e12, "H100 NVL": 835e12, "H100": 989e12, "H200": 989e12, "GH200": 989e12,
             "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def device_peak(name: str) -> float | None:
    """The spec-sheet bf16 dense peak of a device named ``name`` (longest matching key), or None."""
    for key in sorted(BF16_PEAK, key=len, reverse=True):
        if key in name:
            return BF16_PEAK[key]
    return None


def measured_bf16_rate(device: torch.device, n: int = 8192) -> float:
    """FLOP/s of an ``n^3`` bf16 product on ``device`` (mean of 10 after 3 warm-ups)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    _sync(device)
    tic = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync(device)
    return 10 * 2 * n**3 / (time.perf_counter() - tic)


def processor_flops(tokens: int, channels: int, window: int, layers: int, mlp_ratio: int = 4) -> float:
    """Model FLOPs of forward + backward of ``layers`` window-transformer blocks (3x the forward)."""
    dense = 2 * tokens * channels * channels * (3 + 1 + 2 * mlp_ratio)
    attention = 4 * tokens * min(2 * window + 1, tokens) * channels
    return 3.0 * layers * (dense + attention)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_mib(device: torch.device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")


@dataclass
class Row:
    table: str
    precision: str
    kernel: str
    compiled: bool
    step_ms: float = float("nan")
    compile_s: float = float("nan")
    peak_mib: float = float("nan")
    tflops: float = float("nan")
    mfu: float = float("nan")
    loss: float = float("nan")
    note: str = ""
    options: str = ""
    extra: dict = field(default_factory=dict)


def time_steps(step: Callable[[], float], device: torch.device, warmup: int, steps: int) -> tuple[float, float, float]:
    """``(first step seconds, median later step seconds, first loss)``; the first step is the compile."""
    _sync(device)
    tic = time.perf_counter()
    loss = step()
    _sync(device)
    first = time.perf_counter() - tic
    for _ in range(warmup - 1):
        step()
    times = []
    for _ in range(steps):
        _sync(device)
        tic = time.perf_counter()
        step()
        _sync(device)
        times.append(time.perf_counter() - tic)
    return first, statistics.median(times), loss


def _compile(module: torch.nn.Module) -> None:
    from stormshard.models.compile import compile_blocks

    compile_blocks(module)


def run_processor_row(row: Row, tokens: int, channels: int, heads: int, window: int, layers: int,
                      device: torch.device, warmup: int, steps: int, peak: float | None,
                      options: dict | None = None) -> None:
    from stormshard.kernels.flex import set_flex_kernel_options

    set_flex_kernel_options(options)
    try:
        _run_processor_row(row, tokens, channels, heads, window, layers, device, warmup, steps, peak)
    finally:
        set_flex_kernel_options(None)


def _run_processor_row(row: Row, tokens: int, channels: int, heads: int, window: int, layers: int,
                       device: torch.device, warmup: int, steps: int, peak: float | None) -> None:
    torch.manual_seed(0)
    proc = build_transformer_processor(layers, channels, heads, window, attention_kernel=row.kernel).to(device)
    if row.compiled:
        _compile(proc)
    x = torch.randn(1, tokens, channels, device=device, requires_grad=True)
    dtype = torch.bfloat16 if row.precision == "bf16" else torch.float32

    def step() -> float:
        with torch.autocast(device.type, dtype=dtype, enabled=row.precision == "bf16"):
            out = proc(x)
        loss = out.float().square().mean()
        loss.backward()
        proc.zero_grad(set_to_none=True)
        x.grad = None
        return float(loss.detach())

    _finish(row, step, device, warmup, steps, processor_flops(tokens, channels, window, layers), peak)


def mse_training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, target: torch.Tensor,
                      autocast: torch.dtype | None, mark_steps: bool = False) -> Callable[[], float]:
    """One training step as a function: forward (under ``autocast`` when given), the fp32 MSE loss, backward,
    the optimizer step; it returns the loss (a host sync: the benchmarks time whole steps). ``mark_steps``: each
    step begins with :func:`stormshard.models.compile.begin_graphed_step` (blocks compiled with CUDA graphs)."""
    from stormshard.models.compile import begin_graphed_step

    device = x.device

    def step() -> float:
        if mark_steps:
            begin_graphed_step()
        with torch.autocast(device.type, dtype=autocast or torch.float32, enabled=autocast is not None):
            pred = model(x)
        loss = (pred.float() - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    return step


def run_model_row(row: Row, graph, variables: VariableIndex, channels: int, heads: int, window: int,  # noqa: ANN001
                  layers: int, device: torch.device, warmup: int, steps: int, peak: float | None) -> None:
    config = ModelConfig(name="transformer", num_channels=channels, multistep_input=2, trainable_size=8,
                         processor=dict(num_layers=layers, num_heads=heads, window_size=window, mlp_ratio=4,
                                        attention_kernel=row.kernel),
                         encoder=dict(num_heads=heads // 2, num_chunks=2), decoder=dict(num_heads=heads // 2, num_chunks=2),
                         activation_checkpointing=True)
    torch.manual_seed(0)
    model = build_model(config, graph, variables).to(device)
    if row.compiled:
        _compile(model)
    optimizer = build_adamw(model.parameters(), lr=1e-4)  # what training builds: fused on CUDA
    gen = torch.Generator().manual_seed(1)
    cells = graph["data"].num_nodes
    x = torch.randn(1, 2, cells, len(variables.input_names), generator=gen).to(device)
    target = torch.randn(1, cells, len(variables.output_names), generator=gen).to(device)

    step = mse_training_step(model, optimizer, x, target, torch.bfloat16 if row.precision == "bf16" else None)
    flops = processor_flops(graph["hidden"].num_nodes, channels, window, layers)
    _finish(row, step, device, warmup, steps, flops, peak)


def _finish(row: Row, step: Callable[[], float], device: torch.device, warmup: int, steps: int, flops: float,
            peak: float | None) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    first, median, loss = time_steps(step, device, warmup, steps)
    row.step_ms, row.loss, row.peak_mib = median * 1e3, loss, _peak_mib(device)
    row.compile_s = first - median
    row.tflops = flops / median / 1e12
    row.mfu = flops / median / peak if peak else float("nan")


def run_rows(rows: list[Row], run: Callable[[Row], None], budget_end: float) -> None:
    for row in rows:
        if time.perf_counter() > budget_end:
            row.note = "skipped: --budget-s reached"
        else:
            try:
                run(row)
            except Exception as exc:  # noqa: BLE001 - a row that cannot run is reported, the others go on
                row.note = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        print(format_row(row), flush=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def format_row(r: Row) -> str:
    kernel = f"{r.kernel} ({r.options})" if r.options else r.kernel
    if r.note:
        return f"| {r.table} | {r.precision} | {kernel} | {'on' if r.compiled else 'off'} | {r.note} | | | | |"
    compile_s = f"{r.compile_s:.1f}" if r.compiled else "-"
    return (f"| {r.table} | {r.precision} | {kernel} | {'on' if r.compiled else 'off'} | {r.step_ms:.1f} | "
            f"{compile_s} | {r.peak_mib:.0f} | {r.tflops:.1f} | {100 * r.mfu:.1f}% |")


HEADER = ("| case | precision | attention kernel | compile | step ms | compile s | peak MiB | TFLOP/s | MFU |\n"
          "|---|---|---|---|---|---|---|---|---|")


# candidate flex kernel_options (torch's Triton template): forward tiles, backward tiles, TMA loads
FLEX_CANDIDATES: list[tuple[str, dict]] = [
    ("torch default", {}),
    ("TMA loads", {"USE_TMA": True}),
    ("fwd 128x64 w4 s3", {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 4, "fwd_num_stages": 3}),
    ("fwd 128x128 w8 s2", {"fwd_BLOCK_M": 128, "fwd_BLOCK_N": 128, "fwd_num_warps": 8, "fwd_num_stages": 2}),
    ("bwd 64/64 w4 s3", {"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 64, "bwd_BLOCK_M2": 64, "bwd_BLOCK_N2": 64,
                         "bwd_num_warps": 4, "bwd_num_stages": 3}),
    ("bwd 32/128 w4 s3", {"bwd_BLOCK_M1": 32, "bwd_BLOCK_N1": 128, "bwd_BLOCK_M2": 128, "bwd_BLOCK_N2": 32,
                          "bwd_num_warps": 4, "bwd_num_stages": 3}),
]


def _is_phase(options: dict, phase: str) -> bool:
    """True when every key of ``options`` names ``phase`` ("fwd" / "bwd") only."""
    return bool(options) and all(k.startswith(phase + "_") for k in options)


def flex_options_table(device: torch.device, heads: int, tokens: int, head_dim: int, window: int,
                       budget_end: float) -> dict:
    """Time flex attention alone per candidate ``kernel_options``; returns the tuned options (may be {})."""
    from torch.nn.attention.flex_attention import flex_attention

    from stormshard.kernels.flex import window_block_mask

    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, heads, tokens, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
               .requires_grad_() for _ in range(3))
    grad_out = torch.randn(1, heads, tokens, head_dim, device=device, dtype=torch.bfloat16, generator=gen)
    mask = window_block_mask(tokens, tokens, 0, window, device)
    fwd_flops = 4 * tokens * min(2 * window + 1, tokens) * head_dim * heads
    print(f"\nflex attention alone at the AIFS attention shape: batch 1, {heads} heads, {tokens} tokens, head dim "
          f"{head_dim}, window {window}, bf16; median of 5 after warm-up; forward TFLOP/s count the attended "
          "entries, backward counts 2x the forward\n| options | compile s | forward ms | backward ms | forward "
          "TFLOP/s | backward TFLOP/s | max diff vs default (out, dq) |\n|---|---|---|---|---|---|---|", flush=True)
    results: dict[str, tuple[float, float]] = {}
    reference: tuple[torch.Tensor, torch.Tensor] | None = None
    for label, options in FLEX_CANDIDATES:
        if time.perf_counter() > budget_end:
            print(f"| {label} | skipped: --budget-s reached | | | | | |", flush=True)
            continue
        try:
            torch._dynamo.reset()
            fn = torch.compile(flex_attention)
            def run(fn=fn, options=options) -> torch.Tensor:  # noqa: ANN001 - bound per candidate
                return fn(q, k, v, block_mask=mask, scale=head_dim ** -0.5, kernel_options=options or None)

            tic = time.perf_counter()
            out = run()
            out.backward(grad_out)
            _sync(device)
            compile_s = time.perf_counter() - tic
            dq = q.grad.clone()
            for t in (q, k, v):
                t.grad = None
            fwd, both = [], []
            for _ in range(7):
                _sync(device)
                tic = time.perf_counter()
                out = run()
                _sync(device)
                mid = time.perf_counter()
                out.backward(grad_out)
                _sync(device)
                fwd.append(mid - tic)
                both.append(time.perf_counter() - mid)
                for t in (q, k, v):
                    t.grad = None
            f, b = statistics.median(fwd[2:]), statistics.median(both[2:])
            if reference is None:
                reference = (out.detach(), dq)
            diff = (f"{(out.detach() - reference[0]).abs().max().item():.1e}, "
                    f"{(dq - reference[1]).abs().max().item():.1e}")
            results[label] = (f, b)
            print(f"| {label} | {compile_s:.1f} | {f * 1e3:.2f} | {b * 1e3:.2f} | {fwd_flops / f / 1e12:.0f} | "
                  f"{2 * fwd_flops / b / 1e12:.0f} | {diff} |", flush=True)
        except Exception as exc:  # noqa: BLE001 - an option torch refuses is reported, the others go on
            print(f"| {label} | error: {type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''} "
                  "| | | | | |", flush=True)
    torch._dynamo.reset()
    if "torch default" not in results:
        return {}
    base_f, base_b = results["torch default"]
    tuned: dict = {}
    chosen = []
    for phase, index, base in (("fwd", 0, base_f), ("bwd", 1, base_b)):
        best = min((lab for lab, opts in FLEX_CANDIDATES if lab in results and _is_phase(opts, phase)),
                   key=lambda lab: results[lab][index], default=None)
        if best is not None and results[best][index] < 0.98 * base:
            tuned.update(dict(FLEX_CANDIDATES)[best])
            chosen.append(best)
    if "TMA loads" in results and sum(results["TMA loads"]) < 0.98 * (base_f + base_b):
        tuned.update(USE_TMA=True)
        chosen.append("TMA loads")
    print(f"this run's tuned flex options: {', '.join(chosen) if chosen else 'torch default (no candidate beat it by 2%)'}"
          f" {json.dumps(tuned)}", flush=True)
    return tuned


def kernels_here() -> list[str]:
    kernels = ["banded"]
    if flex_attention_unavailable() is None:
        kernels.append("flex")
    if flash_attn_window_func() is not None:
        kernels.append("flash")
    return kernels


def gpu_mode(args: argparse.Namespace, device: torch.device) -> list[Row]:
    name = torch.cuda.get_device_name(device)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    peak = device_peak(name)
    rate = measured_bf16_rate(device)
    print(f"device: {name}; torch {torch.__version__}; bf16 dense peak {peak / 1e12 if peak else float('nan'):.0f} "
          f"TFLOP/s (spec), measured 8192^3 bf16 product {rate / 1e12:.0f} TFLOP/s; kernels here: "
          f"{', '.join(kernels_here())}", flush=True)
    peak = peak or rate
    budget_end = time.perf_counter() + args.budget_s
    layers = args.layers or (2 if args.quick else 4)
    warmup, steps = (2, 3) if args.quick else (2, 5)
    tokens, channels, heads, window = 40320, 1024, 16, 1120
    tuned = {}
    if "flex" in args.tables and flex_attention_unavailable() is None:
        tuned = flex_options_table(device, heads, tokens, channels // heads, window, budget_end)
    combos = [("fp32", "banded", False), ("bf16", "banded", False), ("fp32", "flex", False), ("bf16", "flex", False),
              ("bf16", "flex", True), ("bf16", "banded", True)]
    if "flash" in kernels_here():
        combos.insert(4, ("bf16", "flash", False))
    print(f"\nprocessor at the AIFS shape: {tokens} tokens (O96 hidden grid), {channels} channels, {heads} heads, "
          f"window {window}, {layers} blocks, batch 1, forward + backward, no checkpointing; median of {steps} "
          f"steps after {warmup}\n{HEADER}", flush=True)
    combos = [c for c in combos if _wanted(args, *c)]
    proc_rows = [Row("processor", p, k, c) for p, k, c in combos] if "processor" in args.tables else []
    if proc_rows and _wanted(args, "bf16", "flex", True) and flex_attention_unavailable() is None:
        # the library's flex tiles (flex_window.TUNED_KERNEL_OPTIONS) against torch's, and this run's sweep
        library = TUNED_KERNEL_OPTIONS.get((torch.cuda.get_device_capability(device), torch.bfloat16,
                                            channels // heads))
        print(f"library flex options here: {json.dumps(library) if library else 'torch default'}", flush=True)
        if library:
            proc_rows.append(Row("processor", "bf16", "flex", True, options="torch default tiles",
                                 extra={"kernel_options": {}}))
        if tuned and tuned != library:
            proc_rows.append(Row("processor", "bf16", "flex", True, options="this run's tuned tiles",
                                 extra={"kernel_options": tuned}))
    run_rows(proc_rows, lambda r: run_processor_row(r, tokens, channels, heads, window, layers, device, warmup,
                                                    steps, peak, r.extra.get("kernel_options")), budget_end)
    names = [f"var_{i}" for i in range(64)]
    variables = VariableIndex.build(names, forcing=names[-2:], diagnostic=[])
    tic = time.perf_counter()
    graph = build_graph(GraphConfig(data_grid="o96", hidden="o48", processor=KNNEdges(num_neighbours=8)))
    m_layers = 4 if args.quick else 8
    print(f"\nwhole model: o96 ({graph['data'].num_nodes} cells) -> o48 ({graph['hidden'].num_nodes} nodes), 512 "
          f"channels, {m_layers} layers, window 512, activation checkpointing, AdamW; graph built in "
          f"{time.perf_counter() - tic:.0f} s; MFU counts the processor only\n{HEADER}", flush=True)
    model_combos = [("bf16", "flex", False), ("bf16", "flex", True), ("fp32", "banded", False),
                    ("bf16", "banded", False), ("fp32", "flex", False)]
    model_combos = [c for c in model_combos if _wanted(args, *c)]
    model_rows = [Row("model o96->o48", p, k, c) for p, k, c in model_combos] if "model" in args.tables else []
    run_rows(model_rows, lambda r: run_model_row(r, graph, variables, 512, 16, 512, m_layers, device, warmup, steps,
                                                 peak), budget_end)
    rows = proc_rows + model_rows
    print_ratios(rows)
    return rows


def _wanted(args: argparse.Namespace, precision: str, kernel: str, compiled: bool) -> bool:
    """Whether ``--rows`` (a comma list of ``precision/kernel/on|off``; empty: all) asks for this row."""
    return not args.rows or f"{precision}/{kernel}/{'on' if compiled else 'off'}" in args.rows.split(",")


def print_ratios(rows: list[Row]) -> None:
    def find(table: str, precision: str, kernel: str, compiled: bool) -> Row | None:
        for r in rows:
            if (r.table, r.precision, r.kernel, r.compiled) == (table, precision, kernel, compiled) and not r.note \
                    and not r.options:
                return r
        return None

    print()
    for table in dict.fromkeys(r.table for r in rows):
        for kernel in ("banded", "flex"):
            a, b = find(table, "fp32", kernel, False), find(table, "bf16", kernel, False)
            if a and b:
                print(f"{table}, {kernel}: bf16 vs fp32 speed-up {a.step_ms / b.step_ms:.2f}x, memory "
                      f"{b.peak_mib / a.peak_mib:.2f}x")
        for precision in ("fp32", "bf16"):
            a, b = find(table, precision, "banded", False), find(table, precision, "flex", False)
            if a and b:
                print(f"{table}, {precision}: flex vs banded speed-up {a.step_ms / b.step_ms:.2f}x")
        for kernel in ("banded", "flex"):
            a, b = find(table, "bf16", kernel, False), find(table, "bf16", kernel, True)
            if a and b:
                print(f"{table}, bf16 {kernel}: compiled vs eager speed-up {a.step_ms / b.step_ms:.2f}x "
                      f"(compile {b.compile_s:.0f} s)")
        best_bf16 = [r for r in rows if r.table == table and r.precision == "bf16" and not r.note]
        fp32 = find(table, "fp32", "banded", False)
        if best_bf16 and fp32:
            best = min(best_bf16, key=lambda r: r.step_ms)
            label = f"{best.kernel} ({best.options})" if best.options else best.kernel
            print(f"{table}: fastest bf16 ({label}, compile {'on' if best.compiled else 'off'}) vs fp32 banded "
                  f"{fp32.step_ms / best.step_ms:.2f}x, MFU {100 * best.mfu:.1f}%")


def cpu_mode(args: argparse.Namespace) -> list[Row]:
    """Small shapes: flex vs banded forward of the window kernel; compile vs eager training step."""
    device = torch.device("cpu")
    rows: list[Row] = []
    shapes = [(2048, 64, 4, 64)] if args.quick else [(4096, 512, 8, 64), (4096, 64, 8, 64), (10944, 512, 8, 64)]
    print(f"CPU ({os.cpu_count()} cores, {torch.get_num_threads()} threads), torch {torch.__version__}\n\n"
          "window kernel forward (no_grad, fp32): flex vs banded\n"
          "| tokens | window | heads x dim | banded ms | flex ms | flex first call s | flex vs banded |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    gen = torch.Generator().manual_seed(0)
    for tokens, window, heads, dim in shapes:
        q, k, v = (torch.randn(1, heads, tokens, dim, generator=gen) for _ in range(3))
        def forward(kernel: str, q=q, k=k, v=v, window=window) -> float:  # noqa: ANN001 - bound per shape
            return float(sliding_window_attention(q, k, v, window, kernel=kernel)[0, 0, 0, 0])

        with torch.no_grad():
            first, flex, _ = time_steps(lambda: forward("flex"), device, 1, 3)
            _, banded, _ = time_steps(lambda: forward("banded"), device, 1, 3)
        print(f"| {tokens} | {window} | {heads} x {dim} | {banded * 1e3:.1f} | {flex * 1e3:.1f} | {first:.1f} | "
              f"{banded / flex:.2f}x |", flush=True)
        rows.append(Row("cpu kernel forward", "fp32", "flex", True, step_ms=flex * 1e3, compile_s=first - flex,
                        extra={"tokens": tokens, "window": window, "banded_ms": banded * 1e3}))
    names = [f"var_{i}" for i in range(8)]
    variables = VariableIndex.build(names, forcing=names[-2:], diagnostic=[])
    graph = build_graph(GraphConfig(data_grid="o16", hidden="o8", processor=KNNEdges(num_neighbours=8)))
    channels, layers = (32, 1) if args.quick else (64, 2)
    print(f"\ntraining step, transformer o16 -> o8, {channels} channels, {layers} layers, fp32: compile vs eager\n"
          f"{HEADER}", flush=True)
    train_rows = [Row("cpu model o16->o8", "fp32", "banded", c) for c in (False, True)]
    run_rows(train_rows, lambda r: run_model_row(r, graph, variables, channels, 4, 32, layers, device, 2, 5, None),
             time.perf_counter() + args.budget_s)
    eager, compiled = train_rows
    if not eager.note and not compiled.note:
        print(f"compiled vs eager: {eager.step_ms / compiled.step_ms:.2f}x per step; the compile costs "
              f"{compiled.compile_s:.1f} s, repaid after "
              f"{max(0.0, compiled.compile_s) / max(1e-9, (eager.step_ms - compiled.step_ms) / 1e3):.0f} steps"
              if compiled.step_ms < eager.step_ms else
              f"compiled vs eager: {eager.step_ms / compiled.step_ms:.2f}x per step (compile {compiled.compile_s:.1f} s)")
    return rows + train_rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer layers and steps; the CPU mode without CUDA")
    parser.add_argument("--cpu", action="store_true", help="the CPU mode (small shapes) even with CUDA")
    parser.add_argument("--layers", type=int, default=None, help="processor blocks of the AIFS-shape table")
    parser.add_argument("--budget-s", type=float, default=math.inf, help="start no new row after this many seconds")
    parser.add_argument("--json", default=None, help="write the rows as JSON to this path")
    parser.add_argument("--tables", default="flex,processor,model",
                        help="GPU tables to run: flex (kernel options), processor, model (comma list)")
    parser.add_argument("--rows", default="", help="only these rows of the processor and model tables: a comma list "
                        "of precision/kernel/compile, e.g. bf16/flex/on,fp32/banded/off (default: all)")
    args = parser.parse_args(argv)
    if args.cpu or not torch.cuda.is_available():
        if not args.cpu and not args.quick:
            print("bench_gpu: no CUDA device here; the GPU tables need one (run with --cpu for the CPU mode)")
            return 0
        rows = cpu_mode(args)
    else:
        rows = gpu_mode(args, torch.device("cuda", torch.cuda.current_device()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
