"""The GPU head-to-head with anemoi-models (benchmarks/bench_gpu_vs_anemoi.py) on a CPU: its code paths and its counts.

The benchmark itself needs CUDA (and anemoi's interpreter for anemoi's rows); here, without either:

- its ``--cpu-smoke`` mode at the micro size prints stormshard's rows of both tables (whole-model step
  eager and compiled, graph attention with the csr kernel) with finite numbers, and says that anemoi's
  rows are left out (``--anemoi-python none``; the Triton rows are skipped without ``TRITON_INTERPRET``);
- the model-FLOP formula's dense part equals the FLOPs of the dense products a forward really runs
  (``benchmarks/gemm_timer.py``'s counter, restricted to products with a bias: the Linears), with the
  optional terms (decoder embedding, self projections) on and off; the window attention's pair count
  equals a brute-force count;
- the GPU-busy helpers: the interval union, and the profiler path on CPU events.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys
import time

import pytest
import torch

REPO = pathlib.Path(__file__).resolve().parents[1]


def _load(name: str, path: pathlib.Path):  # noqa: ANN202 - a module
    """The module at ``path`` under ``name`` (registered first: its dataclasses look their module up)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


h2h = _load("bench_gpu_vs_anemoi", REPO / "benchmarks" / "bench_gpu_vs_anemoi.py")  # puts benchmarks/ on sys.path
gemm_timer = _load("gemm_timer", REPO / "benchmarks" / "gemm_timer.py")
step_measure = _load("step_measure", REPO / "benchmarks" / "anemoi_side" / "step_measure.py")


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the interpreter rows: minutes
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "bench_gpu_vs_anemoi.py"), *args], env=env,
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


def _finite(*values: float) -> bool:
    return all(isinstance(v, float | int) and math.isfinite(v) for v in values)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[subprocess.CompletedProcess, dict]:
    """One ``--cpu-smoke`` run for both smoke tests (a process start, the imports and the graphs once): the micro
    size's model table (with its CUDA-graphs row asked for) and attention table, then the checkpointed tiny-ckpt
    size's model table with its selective-checkpointing row; its output and its JSON report."""
    out = tmp_path_factory.mktemp("smoke") / "smoke.json"
    done = _run("--cpu-smoke", "--tables", "model:micro,attention:micro,model:tiny-ckpt", "--anemoi-python", "none",
                "--warmup", "1", "--steps", "1", "--cuda-graphs", "micro", "--selective", "tiny-ckpt",
                "--json", str(out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, json.loads(out.read_text())


def _model_rows(report: dict, size: str) -> dict[str, dict]:
    return {r["impl"]: r for r in report["model_rows"] if r["size"] == size}


@pytest.mark.timeout(600)
def test_cpu_smoke_prints_stormshards_rows_of_both_tables(smoke):
    done, report = smoke
    text = done.stdout
    assert "anemoi rows not asked for" in text
    lines = [line for line in text.splitlines() if line.startswith("| micro | stormshard")]
    assert [line.split("|")[2].strip() for line in lines] == ["stormshard eager", "stormshard compiled",
                                                               f"stormshard {h2h.GRAPHED}"], text
    assert "skipped: CUDA graphs need a CUDA device" in lines[2]
    for line in lines[:2]:
        assert float(line.split("|")[3]) > 0, line  # step ms
    for graph in ("encoder", "processor", "decoder"):
        csr = [line for line in text.splitlines() if line.startswith(f"| {graph} |") and "stormshard csr" in line]
        assert len(csr) == 1, text
        assert all(float(c) > 0 for c in csr[0].split("|")[4:7]), csr  # fwd, bwd, fwd+bwd ms
    rows = _model_rows(report, "micro")
    assert "anemoi not available" in rows["anemoi-models 0.19"]["note"]
    assert "skipped" in rows[f"stormshard {h2h.GRAPHED}"]["note"]
    for impl in ("stormshard eager", "stormshard compiled"):
        r = rows[impl]
        assert r["note"] == "" and _finite(r["step_ms"], r["loss"], r["tflops"], r["compile_s"]), r
        assert r["extra"]["device_events"] > 0  # the profiler step ran (CPU operators here)
    attention = [r for r in report["attention_rows"] if r["impl"] == "stormshard csr"]
    assert len(attention) == 3
    for r in attention:
        assert r["note"] == "" and _finite(r["fwd_ms"], r["bwd_ms"], *r["probes"]) and len(r["probes"]) == 5, r
    # the FLOP count in the report is the formula's on the same graph
    size = h2h.SIZES["micro"]
    graph, _ = h2h.size_graph(size)
    flops = h2h.model_flops(h2h.size_config(size), graph, h2h.size_variables(size))
    assert report["flops"]["micro"]["step"] == pytest.approx(flops.step, rel=1e-12)


@pytest.mark.timeout(600)
def test_cpu_smoke_selective_checkpointing_row(smoke):
    """A checkpointed size gets the compiled row with selective checkpointing (the unchecked micro size none), and
    it trains the same model."""
    done, report = smoke
    assert f"stormshard {h2h.SELECTIVE}" not in _model_rows(report, "micro")
    rows = _model_rows(report, "tiny-ckpt")
    assert list(rows) == ["anemoi-models 0.19", "stormshard eager", "stormshard compiled",
                          f"stormshard {h2h.SELECTIVE}"]
    selective, compiled = rows[f"stormshard {h2h.SELECTIVE}"], rows["stormshard compiled"]
    assert selective["note"] == "" and _finite(selective["step_ms"], selective["loss"]), selective
    assert selective["loss"] == pytest.approx(compiled["loss"], rel=1e-5)  # same weights, same step
    assert f"tiny-ckpt: stormshard {h2h.SELECTIVE} vs compiled (the defaults): " in done.stdout


class _LinearProducts(gemm_timer.DenseGemmTimer):
    """gemm_timer's counter restricted to the products of a Linear with a bias (``addmm`` with a 1-D input)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func.overloadpacket is torch.ops.aten.addmm and args[0].dim() == 1:
            return super().__torch_dispatch__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("key,options", [("tiny", {}), ("tiny-ckpt", {"decoder_embedding": True}),
                                         ("micro", {"self_projection": True, "decoder_embedding": True})])
def test_linear_flops_equal_the_dense_products_a_forward_runs(key, options):
    from stormshard.models.config import ModelConfig
    from stormshard.models.registry import build_model

    size = h2h.SIZES[key]
    graph, _ = h2h.size_graph(size)
    variables = h2h.size_variables(size)
    raw = h2h.size_config(size).model_dump()
    raw["decoder_embedding"] = options.get("decoder_embedding", False)
    for section in ("encoder", "decoder"):
        raw[section]["self_projection"] = options.get("self_projection", False)
    config = ModelConfig(**raw)
    torch.manual_seed(0)
    model = build_model(config, graph, variables)
    x, target = step_measure.model_inputs(graph, variables, torch.device("cpu"))
    flops = h2h.model_flops(config, graph, variables)
    with _LinearProducts() as linear:
        pred = model(x)
    assert linear.flops == flops.linear  # every Linear's product, exactly
    with gemm_timer.DenseGemmTimer() as step:
        (model(x) - target).square().mean().backward()
    # forward + both backward products of every Linear, plus the attention kernels' own dense products
    assert step.flops >= 3 * flops.linear
    assert flops.step == 3 * flops.forward
    c = config.num_channels
    edges = sum(int(graph[e].edge_index.shape[1]) for e in (h2h.ENCODER, h2h.DECODER))
    assert flops.graph_attention == 4 * c * edges
    assert flops.edge_projection == 2 * c * 3 * edges  # 3 edge features (no trainable edge features)
    assert pred.shape == target.shape


@pytest.mark.parametrize("tokens,window", [(1, 0), (5, 0), (5, 1), (17, 3), (17, 16), (17, 40), (64, 8)])
def test_window_pairs_equal_a_brute_force_count(tokens, window):
    i = torch.arange(tokens)
    assert h2h.window_pairs(tokens, window) == int(((i[:, None] - i[None, :]).abs() <= window).sum())


def test_busy_fraction_helpers_on_cpu_events():
    assert step_measure.union_seconds([]) == 0
    assert step_measure.union_seconds([(20, 30), (0, 10), (5, 15), (21, 22), (15, 16)]) == pytest.approx(26e-9)
    a, b = torch.randn(256, 256), torch.randn(256, 256)

    def work() -> None:
        with torch.profiler.record_function("a range with an idle gap"):  # an annotation is not busy time
            for _ in range(5):
                a @ b
            time.sleep(0.2)

    busy, events, wall, kinds = step_measure.profiled_busy(work, torch.device("cpu"))
    assert events >= 5 and 0 < busy < wall - 0.15, (busy, wall)
    assert kinds["user_annotation"] >= 1 and kinds["cpu_op"] == events  # seen, and left out of the busy time


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-CUDA message needs a machine without CUDA")
def test_without_cuda_it_says_so_and_exits_0(capsys):
    assert h2h.main([]) == 0  # in this process: the smoke tests run the script itself
    assert "no CUDA device here" in capsys.readouterr().out


def test_tile_sweep_arguments(capsys):
    """``--triton-tiles`` parses as heads-per-program x edges x warps [x nodes per program] (powers of two); the tile
    table needs it."""
    from stormshard.kernels.graph_triton import Tiles

    assert h2h.parse_tiles("4x8x8") == Tiles(4, 8, 8) and h2h.parse_tiles("16X8X8") == Tiles(16, 8, 8)
    assert h2h.parse_tiles("4x4x4x4") == Tiles(4, 4, 4, 4)
    for bad in ("4x8", "4x8x3", "axbxc", "4x4x4x3", "4x4x4x4x4"):
        with pytest.raises(ValueError):
            h2h.parse_tiles(bad)
    # the command line's errors, in this process (argparse exits 2 before anything runs)
    with pytest.raises(SystemExit) as exit_:
        h2h.main(["--cpu-smoke", "--tables", "tiles:micro"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--triton-tiles" in err, err[-2000:]
    with pytest.raises(SystemExit) as exit_:
        h2h.main(["--cpu-smoke", "--tables", "attention:micro", "--triton-tiles", "4x8"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "heads-per-program x edges-per-tile x warps" in err, err[-2000:]
