"""anemoi-models' side of ``benchmarks/bench_gpu_vs_anemoi.py``: run in anemoi's interpreter, stormshard on PYTHONPATH.

    <anemoi python> benchmarks/anemoi_side/gpu_vs_stormshard.py JOB.json

The job (written by ``bench_gpu_vs_anemoi.run_anemoi``) names a task, the size, the graph file, the device,
dtype, warm-up / timed steps and the wall-clock time (``time.time()``) after which no row starts; the
result goes to ``job["out"]`` as JSON.

- ``"model"``: stormshard's model of the size is built and given the job's weights (the state dict the
  stormshard rows load), mapped onto anemoi's model by :func:`stormshard.checkpoint.anemoi_plan.plan_anemoi_export`
  (identity normaliser: mean 0, stdev 1) with anemoi's GPU settings written into the plan's config
  (mappers ``graph_attention_backend: "triton"``; checkpointing as stormshard's: processor blocks one per
  chunk when the size checkpoints, mappers not) and built by
  :func:`stormshard.checkpoint.anemoi_build.build_anemoi_interface`, as ``export-anemoi`` does. Both
  models' fp32 forward (TF32 off; anemoi's processor with SDPA, as flash-attn has no fp32) on the
  benchmark's input are compared (``check``); then the processor takes anemoi's GPU default,
  ``attention_implementation`` "flash_attention" when flash-attn imports on CUDA (else SDPA, a dense band
  mask), and anemoi's training step (``interface.model({"data": x})``, bf16 autocast, fp32 MSE, backward,
  AdamW) is timed like stormshard's (``step_measure.finish_model_row``). The row says which graph backend
  and processor attention anemoi's modules ended up with (anemoi falls back to "pyg" without CUDA).
- ``"attention"``: per graph (encoder, processor, decoder) one block's attention as anemoi's
  ``GraphTransformerBaseBlock`` with the triton backend computes it: ``lin_edge`` of the edge attributes
  to ``(E, heads, d)``, ``edge_index_to_csc`` (edges already destination-sorted) and
  ``anemoi.models.triton.gt.graph_transformer_attention_conv``, forward + backward, on the same seeded
  inputs as stormshard's rows (``step_measure.attention_inputs``). On a CPU under ``TRITON_INTERPRET=1``
  the same Triton kernels run through the custom ops' Python functions (the ops themselves are CUDA-only).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/: bench_gpu, bench_gpu_vs_anemoi

import bench_gpu_vs_anemoi as h2h  # noqa: E402
from step_measure import (  # noqa: E402
    AttentionRow,
    ModelRow,
    attention_graphs,
    attention_inputs,
    finish_model_row,
    measure_attention,
    model_inputs,
)

from stormshard.graphs.builder import load_graph  # noqa: E402


def flash_importable() -> bool:
    """Whether anemoi's ``FlashAttentionWrapper`` can import flash-attn (v2 ``flash_attn``, v3 ``flash_attn_interface``)."""
    return any(importlib.util.find_spec(m) is not None for m in ("flash_attn", "flash_attn_interface"))


def build_pair(job: dict, device: torch.device) -> tuple[torch.nn.Module, torch.nn.Module, object, object, str]:
    """(stormshard model, anemoi interface, graph, variables, processor attention) with the job's weights."""
    from stormshard.checkpoint.anemoi_build import build_anemoi_interface
    from stormshard.checkpoint.anemoi_plan import ExportSource, plan_anemoi_export
    from stormshard.models.registry import build_model

    size = h2h.Size(**job["size"])
    graph, variables, config = load_graph(job["graph"]), h2h.size_variables(size), h2h.size_config(size)
    weights = torch.load(job["weights"], weights_only=True)
    ours = build_model(config, graph, variables)
    ours.load_state_dict(weights)
    n = len(variables.variables)
    stats = {"mean": np.zeros(n), "stdev": np.ones(n), "minimum": -5 * np.ones(n), "maximum": 5 * np.ones(n)}
    source = ExportSource(path=Path(f"bench_gpu_vs_anemoi:{size.key}"), config=config, graph=graph,
                          variables=variables, weights=weights, statistics=stats,
                          normalisation={"default": "mean-std", "methods": {}}, timestep="6h", step=0, dataset={})
    plan = plan_anemoi_export(source)
    attention = ("flash_attention" if device.type == "cuda" and flash_importable()
                 else "scaled_dot_product_attention")
    model = plan.config["model"]
    # built with SDPA (fp32 for the check: flash-attn takes bf16 / fp16 only), switched by use_attention
    model["processor"].update(attention_implementation="scaled_dot_product_attention",
                              gradient_checkpointing=size.checkpointing,
                              num_chunks=size.layers if size.checkpointing else 1)
    for side in (model["encoders"]["0"]["mapper"], model["decoders"]["0"]["mapper"]):
        side.update(graph_attention_backend="triton", gradient_checkpointing=False)
    interface, _ = build_anemoi_interface(plan, source.path)
    return ours, interface, graph, variables, attention


def use_attention(interface: torch.nn.Module, attention: str) -> None:
    """Every anemoi ``MultiHeadSelfAttention`` of ``interface`` switched to ``attention`` (its own setter)."""
    for m in interface.modules():
        if hasattr(m, "attention_implementation") and hasattr(m, "set_attention_function"):
            m.attention_implementation = attention
            m.set_attention_function()


def anemoi_settings(interface: torch.nn.Module, attention: str) -> str:
    """What anemoi's modules run: their graph backends and the processor's attention wrapper."""
    backends = sorted({m.graph_attention_backend for m in interface.modules() if hasattr(m, "graph_attention_backend")})
    wrappers = sorted({type(m).__name__ for m in interface.modules() if type(m).__name__.endswith("AttentionWrapper")})
    what = {"FlashAttentionWrapper": "flash-attn", "SDPAAttentionWrapper": "SDPA with a dense band mask"}
    procs = ", ".join(what.get(w, w) for w in wrappers) or attention
    why = ("" if attention == "flash_attention" else
           ", flash-attn not importable" if not flash_importable() else ", flash-attn needs CUDA")
    return f"graph: {'/'.join(backends) or '?'}; processor: {procs}{why}"


def compare(ours: torch.nn.Module, interface: torch.nn.Module, graph, variables, device: torch.device) -> dict:  # noqa: ANN001
    """fp32 forward of both models on the benchmark input (TF32 off): the largest difference, absolute and
    relative to the largest predicted increment (output minus the carried state) and to the largest output."""
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        x, _ = model_inputs(graph, variables, device)
        ours.to(device).eval()
        interface.to(device).eval()
        with torch.no_grad():
            s = ours(x).double()
            a = interface.model({"data": x[:, :, None]})["data"][:, 0, 0].double()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
    carried = torch.zeros_like(s)
    carried[..., list(variables.prognostic_in_output)] = x[:, -1][..., list(variables.prognostic_in_input)].double()
    diff = float((a - s).abs().max())
    return {"max_abs": diff, "max_rel_increment": diff / max(float((s - carried).abs().max()), 1e-30),
            "max_rel_output": diff / max(float(s.abs().max()), 1e-30), "shape": list(s.shape)}


def model_task(job: dict, device: torch.device, dtype: torch.dtype) -> dict:
    size = h2h.Size(**job["size"])
    row = ModelRow(size.key, "anemoi-models 0.19")
    if time.time() > job["budget_end"]:
        row.note = "skipped: --budget-s reached"
        return {"model": asdict(row)}
    import anemoi.models

    tic = time.perf_counter()
    ours, interface, graph, variables, attention = build_pair(job, device)
    try:
        check = compare(ours, interface, graph, variables, device)
        print(f"anemoi side ({size.key}): built in {time.perf_counter() - tic:.0f} s; fp32 forward vs stormshard: max "
              f"abs diff {check['max_abs']:.3g}, {check['max_rel_increment']:.3g} of the largest increment", flush=True)
    except Exception as exc:  # noqa: BLE001 - e.g. out of memory in fp32: reported, the timing still runs
        traceback.print_exc()
        check = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"}
    del ours
    use_attention(interface, attention)  # flash-attn where it imports on CUDA (anemoi's GPU default)
    interface.to(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    interface.train()
    x, target = model_inputs(graph, variables, device)
    x5 = x[:, :, None]
    optimizer = torch.optim.AdamW([p for p in interface.parameters() if p.requires_grad], lr=1e-4)

    def step() -> float:
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            pred = interface.model({"data": x5})["data"][:, 0, 0]
        loss = (pred.float() - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return float(loss.detach())

    finish_model_row(row, step, device, job["warmup"], job["steps"], job["flops"], job["peak"])
    row.extra["attention"] = anemoi_settings(interface, attention)
    return {"model": asdict(row), "check": check, "version": anemoi.models.__version__}


class _InterpretedConv(torch.autograd.Function):
    """anemoi's Triton forward and backward through the custom ops' Python functions (CPU, TRITON_INTERPRET=1)."""

    @staticmethod
    def forward(ctx, q, k, v, e, row, colptr, rowptr, edge_ids, edge_dst):  # noqa: ANN001, ANN205
        from anemoi.models.triton.gt import graph_transformer_attention

        out, out_saved, m = graph_transformer_attention._init_fn(q, k, v, e, row, colptr, rowptr, edge_ids, edge_dst)
        ctx.save_for_backward(q, k, v, e, out_saved, m, row, colptr, rowptr, edge_ids, edge_dst)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        from anemoi.models.triton.gt import graph_transformer_attention_backward

        dq, dk, dv, de = graph_transformer_attention_backward._init_fn(grad.contiguous(), *ctx.saved_tensors)
        return dq, dk, dv, de, None, None, None, None, None


def attention_task(job: dict, device: torch.device, dtype: torch.dtype) -> dict:
    size = h2h.Size(**job["size"])
    graph = load_graph(job["graph"])
    rows = []
    interpreted = device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"
    heads, d = size.heads, size.channels // size.heads
    for name, edge_index, num_src, num_dst in attention_graphs(graph):
        edges = int(edge_index.shape[1])
        row = AttentionRow(name, "anemoi triton", edges)
        rows.append(row)
        if time.time() > job["budget_end"]:
            row.note = "skipped: --budget-s reached"
            continue
        if device.type != "cuda" and not interpreted:
            row.note = "skipped: anemoi's Triton kernel needs CUDA (or TRITON_INTERPRET=1 on a CPU)"
            continue
        try:
            from anemoi.models.triton.gt import graph_transformer_attention_conv
            from anemoi.models.triton.utils import edge_index_to_csc

            index = edge_index.to(device)
            inputs = attention_inputs(num_src, num_dst, edges, size.channels, heads, 3, device, dtype)

            def forward(inputs=inputs, index=index, num_src=num_src, num_dst=num_dst, edges=edges) -> torch.Tensor:  # noqa: ANN001
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    e = torch.nn.functional.linear(inputs["attr"], inputs["weight"], inputs["bias"])
                    e = e.view(edges, heads, d)
                    csc, _, reverse = edge_index_to_csc(index, num_nodes=(num_src, num_dst), reverse=True,
                                                        edges_are_dst_sorted=True)
                    if interpreted:
                        return _InterpretedConv.apply(inputs["q"], inputs["k"], inputs["v"], e, *csc, *reverse)
                    return graph_transformer_attention_conv(inputs["q"], inputs["k"], inputs["v"], e, csc, reverse)

            measure_attention(row, forward, inputs, device, job["warmup"], job["steps"])
        except Exception as exc:  # noqa: BLE001 - reported in the row, the other graphs go on
            traceback.print_exc()
            row.note = f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        finally:
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return {"attention": [asdict(r) for r in rows]}


def main(argv: list[str]) -> int:
    job = json.loads(Path(argv[0]).read_text())
    device = torch.device("cuda" if job["device"] == "cuda" else "cpu")
    dtype = getattr(torch, job["dtype"])
    try:
        result = (model_task if job["task"] == "model" else attention_task)(job, device, dtype)
    except Exception as exc:  # noqa: BLE001 - the error goes back to the stormshard side as the row's note
        traceback.print_exc()
        result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"}
    Path(job["out"]).write_text(json.dumps(result, default=str))  # NaN stays NaN (json reads it back)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
