"""Layers and kernels on CUDA against the CPU float64 reference, in fp32 and bf16; flash-attn's
window path against the banded kernel (with the shifted offsets ``shard_sequence`` passes for a
rank's halo); Transformer Engine's linear against torch's. Skipped without CUDA; times printed
with ``-s``.

Tolerances (relative max-norm): fp32 on CUDA 1e-4 (TF32 is off for matmuls by default in torch;
different reduction orders only), bf16 3e-2 (as tests/test_bf16.py: a few bf16 roundings).
"""

from __future__ import annotations

import copy
import time

import pytest
import torch

from tests.test_bf16 import _first, _layers, _rel_max

FP32_TOL, BF16_TOL = 1e-4, 3e-2


def _timed(fn, repeat: int = 5) -> float:  # noqa: ANN001
    fn()
    torch.cuda.synchronize()
    tic = time.perf_counter()
    for _ in range(repeat):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - tic) / repeat


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layers_on_cuda_match_cpu_float64(dtype):
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    for name, module, inputs in _layers():
        module = module.to(torch.bfloat16).float()
        inputs = tuple(t.bfloat16().float() for t in inputs)
        ref_in = [t.double().requires_grad_() for t in inputs]
        ref = _first(copy.deepcopy(module).double()(*ref_in))
        ref.square().sum().backward()
        cuda_module = copy.deepcopy(module).cuda().to(dtype)
        cuda_in = [t.cuda().to(dtype).requires_grad_() for t in inputs]
        out = _first(cuda_module(*cuda_in))
        out.float().square().sum().backward()
        err = _rel_max(out.cpu(), ref)
        grad_err = _rel_max(cuda_in[0].grad.cpu(), ref_in[0].grad)
        print(f"{name} {dtype}: output error {err:.1e}, input-gradient error {grad_err:.1e}")
        assert err < tol and grad_err < 2 * tol, (name, err, grad_err)


def test_model_on_cuda_matches_cpu_float64(tmp_path):
    """The tiny encoder-processor-decoder (transformer and graph-transformer processors) on CUDA in
    fp32 and bf16 against the same model in float64 on the CPU."""
    from stormshard.data.synthetic import generate_synthetic_dataset
    from stormshard.graphs.builder import load_or_build_graph
    from stormshard.models.registry import build_model
    from stormshard.training.config import load_experiment_config
    from stormshard.training.preflight import preflight
    from tests.tiny_run import tiny_config

    dataset = tmp_path / "synthetic.zarr"
    generate_synthetic_dataset(dataset, grid="o8", steps=64, seed=1)
    for changes in ({}, {"model.name": "graphtransformer", "graph.hidden": "ico1",
                         "graph.processor": {"kind": "multimesh"}}):
        cfg = load_experiment_config(tiny_config(str(dataset), tmp_path / "run", **changes))
        inputs = preflight(cfg, 1)
        graph = load_or_build_graph(cfg.graph, tmp_path / f"graph{len(changes)}.pt",
                                    data_latlon=(inputs.dataset.latitudes, inputs.dataset.longitudes))
        torch.manual_seed(0)
        model = build_model(cfg.model, graph, inputs.variables, None,
                            shard_strategy=cfg.parallel.shard_strategy or "shard_sequence").to(torch.bfloat16).float()
        x = torch.randn(2, cfg.model.multistep_input, graph["data"].num_nodes, len(inputs.variables.input_names))
        x = x.bfloat16().float()
        with torch.no_grad():
            ref = copy.deepcopy(model).double()(x.double())
            for dtype, tol in ((torch.float32, FP32_TOL), (torch.bfloat16, BF16_TOL)):
                out = copy.deepcopy(model).cuda().to(dtype)(x.cuda().to(dtype))
                err = _rel_max(out.cpu(), ref)
                print(f"model {cfg.model.name} {dtype}: output error {err:.1e}")
                assert err < tol, (cfg.model.name, dtype, err)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_window_kernel_on_cuda(dtype):
    """The banded kernel on CUDA against the CPU float64 dense reference, forward and backward,
    with the offsets of a middle rank's halo under shard_sequence (queries shifted into the keys)."""
    from stormshard.kernels.dispatch import sliding_window_attention
    from stormshard.kernels.reference import dense_window_attention

    g = torch.Generator().manual_seed(0)
    window, seq, halo = 32, 256, 32
    q = torch.randn(2, 4, seq, 64, generator=g).to(dtype).float()
    k, v = (torch.randn(2, 4, seq + 2 * halo, 64, generator=g).to(dtype).float() for _ in range(2))
    ref_in = [t.double().requires_grad_() for t in (q, k, v)]
    ref = dense_window_attention(*ref_in, window, q_offset=halo, k_offset=0)
    ref.square().sum().backward()
    cuda_in = [t.cuda().to(dtype).requires_grad_() for t in (q, k, v)]
    out = sliding_window_attention(*cuda_in, window, q_offset=halo, k_offset=0)
    out.float().square().sum().backward()
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    assert _rel_max(out.cpu(), ref) < tol
    for got, want in zip(cuda_in, ref_in, strict=True):
        assert _rel_max(got.grad.cpu(), want.grad) < 2 * tol


def test_flash_attn_window_matches_banded():
    """flash-attn's window path (bf16, when importable and >= 2.3) against the banded kernel, forward
    and backward, at the offsets shard_sequence passes (no shift, a halo shift, the last rank)."""
    from stormshard.kernels import dispatch as W

    if W.flash_attn_window_func() is None:
        pytest.skip("flash-attn >= 2.3 is not importable: the banded kernel is the CUDA path")
    g = torch.Generator().manual_seed(1)
    window, seq = 64, 1024
    for q_len, k_len, q_offset in ((seq, seq, 0), (seq, seq + 2 * window, window), (seq, seq + window, window)):
        q = torch.randn(2, 8, q_len, 64, generator=g).cuda().bfloat16()
        k, v = (torch.randn(2, 8, k_len, 64, generator=g).cuda().bfloat16() for _ in range(2))
        flash_in = [t.clone().requires_grad_() for t in (q, k, v)]
        banded_in = [t.clone().float().requires_grad_() for t in (q, k, v)]  # fp32: the banded path
        flash = W.sliding_window_attention(*flash_in, window, q_offset=q_offset, k_offset=0)
        banded = W.sliding_window_attention(*banded_in, window, q_offset=q_offset, k_offset=0)
        assert flash.dtype == torch.bfloat16
        flash.float().square().sum().backward()
        banded.square().sum().backward()
        assert _rel_max(flash.float(), banded.double()) < BF16_TOL
        for a, b in zip(flash_in, banded_in, strict=True):
            assert _rel_max(a.grad.float(), b.grad.double()) < 2 * BF16_TOL
        t_flash = _timed(lambda: W.sliding_window_attention(q, k, v, window, q_offset=q_offset))  # noqa: B023
        t_band = _timed(lambda: W.sliding_window_attention(q.float(), k.float(), v.float(), window,  # noqa: B023
                                                           q_offset=q_offset))  # noqa: B023
        print(f"window {window}, Lq {q_len}, Lk {k_len}: flash {t_flash * 1e3:.2f} ms, banded fp32 "
              f"{t_band * 1e3:.2f} ms ({t_band / t_flash:.1f}x)")


def test_transformer_engine_linear_matches_torch():
    from stormshard.parallel.te_backend import LocalLinear, transformer_engine_available

    if not transformer_engine_available():
        pytest.skip("transformer_engine.pytorch is not importable")
    torch.manual_seed(0)
    lin = torch.nn.Linear(256, 128).cuda()
    x = torch.randn(4, 64, 256, device="cuda", requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out = LocalLinear(allow_te=True)(x, lin.weight, lin.bias)
    ref = torch.nn.functional.linear(x_ref, lin.weight, lin.bias)
    assert _rel_max(out.detach().cpu(), ref.detach().cpu().double()) < 1e-3  # TE may use TF32
    out.square().sum().backward()
    ref.square().sum().backward()
    assert _rel_max(x.grad.cpu(), x_ref.grad.cpu().double()) < 1e-3


def test_lean_graph_paths_on_cuda_match_the_plain_model():
    """The memory-lean paths (norms inside their projections, the row-chunked MLP with its norm: custom ops) on
    CUDA under bf16 autocast against the same model's plain composition, forced on at a small size; and the
    memory they save on a real decoder-like MLP (max_memory_allocated over forward + backward)."""
    from stormshard.layers.row_chunked_mlp import RowChunkedMLP
    from stormshard.models.registry import build_model
    from tests.test_graph_layers import force_lean_paths
    from tests.test_models import VARIABLES, _config, _graph

    config, _ = _config("graphtransformer-anemoi")
    graph = _graph(config.uses_graph_processor)
    x = torch.randn(2, 2, graph["data"].num_nodes, len(VARIABLES.input_names), device="cuda")
    results = {}
    for lean in (False, True):
        torch.manual_seed(7)
        model = build_model(config, graph, VARIABLES).cuda()
        if lean:
            force_lean_paths(model)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x)
        out.float().square().sum().backward()
        results[lean] = [out.detach().float()] + [p.grad.float() for _, p in model.named_parameters()]
    errors = [_rel_max(a.cpu(), b.cpu()) for a, b in zip(results[True], results[False], strict=True)]
    print(f"lean vs plain on CUDA (bf16): output {errors[0]:.1e}, worst gradient {max(errors[1:]):.1e}")
    assert errors[0] < BF16_TOL and max(errors[1:]) < 3 * BF16_TOL

    rows, peaks = 200_000, {}
    xin = torch.randn(rows, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for name, min_elements in (("plain", None), ("lean", 0)):
        mlp = RowChunkedMLP(256, 1024, min_elements=min_elements).cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = mlp(xin)
        y.float().square().sum().backward()
        torch.cuda.synchronize()
        peaks[name] = torch.cuda.max_memory_allocated() - base
        xin.grad = None
        del y, mlp
    hidden = rows * 1024 * 2
    print(f"MLP on {rows} rows x 1024 hidden (bf16): peak above the start {peaks['plain'] / 2**20:.0f} MiB plain, "
          f"{peaks['lean'] / 2**20:.0f} MiB row-chunked")
    assert peaks["plain"] - peaks["lean"] >= 1.5 * hidden


@pytest.mark.parametrize("compiled", [True, False])
def test_checkpointed_mappers_and_selective_blocks_on_cuda_match_the_plain_model(compiled):
    """A graph-transformer model (the Triton graph kernel on CUDA) with its processor blocks and mappers
    checkpointed, selective and full, compiled per block or eager, under bf16 autocast, against the same model
    without checkpointing: the kept graph attention outputs and the recomputed rest give the same step. Eager, the
    third step's selective blocks keep the kernels' outputs without a dispatch mode, the recompute running on
    autograd's device thread (:mod:`stormshard.kernels.kept_outputs`)."""
    from stormshard.layers.checkpointing import ActivationCheckpoint
    from stormshard.models.compile import compile_blocks
    from stormshard.models.config import ModelConfig
    from stormshard.models.registry import build_model
    from tests.test_models import VARIABLES, _config, _graph

    base, _ = _config("graphtransformer")
    graph = _graph(base.uses_graph_processor)
    x = torch.randn(2, 2, graph["data"].num_nodes, len(VARIABLES.input_names), device="cuda")
    results = {}
    for name, update in (("plain", {}), ("selective", {"activation_checkpointing": "selective",
                                                      "encoder": {"activation_checkpointing": "selective"},
                                                      "decoder": {"activation_checkpointing": True}})):
        config = ModelConfig(**{**base.model_dump(), **update,
                                "encoder": {**base.encoder.model_dump(), **update.get("encoder", {})},
                                "decoder": {**base.decoder.model_dump(), **update.get("decoder", {})}})
        torch.manual_seed(7)
        model = build_model(config, graph, VARIABLES).cuda()
        if compiled:
            compile_blocks(model)
        for _ in range(2 if compiled else 3):  # compiled: the second step runs the compiled code
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(x)
            out.float().square().sum().backward()
        results[name] = [out.detach().float()] + [p.grad.float() for _, p in model.named_parameters()]
        if name == "selective" and not compiled:
            assert all(m.keeps_own_outputs() for m in model.modules()
                       if isinstance(m, ActivationCheckpoint) and m.mode == "selective")
    errors = [_rel_max(a.cpu(), b.cpu()) for a, b in zip(results["selective"], results["plain"], strict=True)]
    print(f"checkpointed (selective processor and encoder, full decoder) vs plain, "
          f"{'compiled' if compiled else 'eager'}, bf16: output "
          f"{errors[0]:.1e}, worst gradient {max(errors[1:]):.1e}")
    assert errors[0] < BF16_TOL and max(errors[1:]) < 3 * BF16_TOL


def test_truncated_residual_on_cuda_matches_cpu_float64():
    """The truncated residual's CSR products (cuSPARSE, int32 indices) on CUDA in fp32, inside bf16 autocast (it
    turns autocast off: the carried state stays fp32), against the CPU float64 layer; forward and input gradient."""
    from stormshard.graphs.builder import (
        TRUNCATION_DOWN,
        TRUNCATION_UP,
        GraphConfig,
        TruncationGrid,
        build_graph,
    )
    from stormshard.layers.truncation import TruncatedResidual
    from stormshard.parallel.shard import SequenceShard

    graph = build_graph(GraphConfig(data_grid="o16", hidden="o4", processor={"kind": "knn", "num_neighbours": 4},
                                    truncation=TruncationGrid(grid="o4")))
    down, up = graph[TRUNCATION_DOWN], graph[TRUNCATION_UP]
    layer = TruncatedResidual(down.edge_index, down.edge_weight, up.edge_index, up.edge_weight,
                              graph["truncation"].num_nodes, SequenceShard.unsharded(graph["data"].num_nodes))
    x = torch.randn(2, graph["data"].num_nodes, 7, dtype=torch.float64)
    ref_x = x.clone().requires_grad_()
    ref = layer(ref_x)
    ref.square().sum().backward()
    cuda_x = x.float().cuda().requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = layer.cuda()(cuda_x)
    assert out.dtype == torch.float32
    out.square().sum().backward()
    err, grad_err = _rel_max(out.detach().cpu(), ref), _rel_max(cuda_x.grad.cpu(), ref_x.grad)
    print(f"truncated residual fp32: output error {err:.1e}, input-gradient error {grad_err:.1e}")
    assert err < FP32_TOL and grad_err < FP32_TOL, (err, grad_err)
