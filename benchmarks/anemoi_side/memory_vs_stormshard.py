"""anemoi-models' side of ``benchmarks/bench_memory.py --anemoi-python``: anemoi's training step on fake tensors.

    <anemoi python> benchmarks/anemoi_side/memory_vs_stormshard.py --size aifs --attention flash \\
        [--mapper-checkpointing] [--json PATH]

Run in anemoi's interpreter with stormshard on PYTHONPATH. anemoi's model of the size is built from stormshard's
(the same config, graph and weights: :func:`gpu_vs_stormshard.build_pair`, as ``export-anemoi`` does), with the
settings of the GPU head-to-head: mappers on anemoi's Triton graph backend (forced on: anemoi picks it only
where CUDA is present; its custom ops' fake implementations give the outputs and the tensors they keep, the fp32
copy of the attention output included), processor blocks checkpointed one per chunk when the size checkpoints,
mappers not (``--mapper-checkpointing``: anemoi's own default, ``gradient_checkpointing: True`` on encoder and
decoder). The processor's attention (``--attention``): ``flash``, anemoi's GPU default, by flash-attn v2's
memory contract (it keeps q, k, v, the output and the fp32 log-sum-exp; its backward makes dq, dk, dv and an fp32
dq accumulator), or ``sdpa``, anemoi's fallback, torch's SDPA with anemoi's dense band mask (the ``(Q, KV)``
bool tensor anemoi keeps; its memory-efficient kernel's contract on CUDA: q, k, v, the output and the fp32
log-sum-exp). The step is
anemoi-training's: bf16 autocast, fp32 MSE, backward, ``torch.optim.AdamW`` (foreach, as on CUDA). The recording
and the analysis are stormshard's (:func:`memory_simulation.simulate_step_memory`).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import types
from dataclasses import asdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # benchmarks/
sys.path.insert(0, str(HERE))

import bench_gpu_vs_anemoi as h2h  # noqa: E402
import memory_simulation as sim  # noqa: E402

GIB = 1024 ** 3


def _install_flash_attn() -> None:
    """A ``flash_attn`` module whose ``flash_attn_func`` is flash-attn v2's memory contract
    (:func:`memory_simulation.attention_memory`; inputs ``(batch, seq, heads, d)``), for anemoi's wrapper."""
    module = types.ModuleType("flash_attn")
    module.__version__ = "2.7.4"
    module.flash_attn_func = lambda q, k, v, **kwargs: sim.attention_memory(
        q, k, v, lse_shape=(q.shape[0], q.shape[2], q.shape[1]), dq_accumulator=True)
    sys.modules["flash_attn"] = module


def _sdpa_memory(query, key, value, attn_mask=None, **kwargs):  # noqa: ANN001, ANN202
    """CUDA SDPA's memory-efficient kernel with a mask, in memory only (it keeps the mask too)."""
    return sim.attention_memory(query, key, value, lse_shape=query.shape[:-1], keep=attn_mask)


def _force_triton_backend() -> None:
    """anemoi's Triton graph backend on a machine without CUDA (anemoi asks ``torch.cuda.is_available()``)."""
    from anemoi.models.layers import block
    from anemoi.models.triton import gt

    block.is_triton_available = lambda: True
    block.graph_transformer_attention_conv = gt.graph_transformer_attention_conv


def anemoi_step(size_key: str, attention: str, mapper_checkpointing: bool):  # noqa: ANN201
    """``(step, parameters, fake mode, label)``: anemoi's model of the size on fake tensors (module docstring)."""
    from gpu_vs_stormshard import build_pair, use_attention
    from torch._subclasses.fake_tensor import FakeTensorMode

    from stormshard.models.registry import build_model

    _force_triton_backend()
    size = h2h.SIZES[size_key]
    graph, graph_path = h2h.size_graph(size)
    torch.manual_seed(0)
    weights = build_model(h2h.size_config(size), graph, h2h.size_variables(size)).state_dict()
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(weights, Path(tmp) / "weights.pt")
        del weights
        job = {"size": asdict(size), "graph": str(graph_path), "weights": str(Path(tmp) / "weights.pt")}
        ours, interface, graph, variables, _ = build_pair(job, torch.device("cpu"))
    del ours
    if attention == "flash":
        _install_flash_attn()
        use_attention(interface, "flash_attention")
    else:  # anemoi's SDPA wrappers hold the function they call, and build their mask once
        for m in interface.modules():
            if type(m).__name__ == "SDPAAttentionWrapper":
                m.attention = _sdpa_memory
                # the (Q, KV) bool mask anemoi keeps, without computing it (its int64 intermediates are 13 GB each
                # at O96: a transient of the first forward only)
                m.create_sliding_window_mask = (lambda b, h, q_len, kv_len, window_size, device="cpu":
                                                torch.empty(q_len, kv_len, dtype=torch.bool))
    for m in interface.modules():
        if hasattr(m, "gradient_checkpointing") and "Mapper" in type(m).__name__:
            m.gradient_checkpointing = mapper_checkpointing
    backends = sorted({m.graph_attention_backend for m in interface.modules() if hasattr(m, "graph_attention_backend")})
    interface.train()
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    parameters = sim.fake_parameters(interface, mode)
    cells = graph["data"].num_nodes
    with mode:
        x5 = torch.empty(1, 2, 1, cells, len(variables.input_names))
        target = torch.empty(1, cells, len(variables.output_names))
    optimizer = torch.optim.AdamW([p for p in parameters if p.requires_grad], lr=1e-4, foreach=True)

    def step() -> None:  # gpu_vs_stormshard.model_task's step without its loss readout
        with torch.autocast("cpu", dtype=torch.bfloat16):
            pred = interface.model({"data": x5})["data"][:, 0, 0]
        loss = (pred.float() - target).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    label = (f"anemoi-models, {size.label}, bf16; graph: {'/'.join(backends)}; processor: "
             f"{'flash-attn' if attention == 'flash' else 'SDPA, dense band mask'}; mappers "
             f"{'checkpointed (anemoi default)' if mapper_checkpointing else 'not checkpointed'}")
    return step, parameters, mode, label


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="aifs")
    parser.add_argument("--attention", default="flash", choices=("flash", "sdpa"))
    parser.add_argument("--mapper-checkpointing", action="store_true")
    parser.add_argument("--top", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    step, parameters, mode, label = anemoi_step(args.size, args.attention, args.mapper_checkpointing)
    with mode:
        result = sim.simulate_step_memory(step, parameters, fake_mode=mode)
    print(f"{label}: peak {result.census.peak / GIB:.2f} GiB")
    print(result.table(args.top))
    if args.json:
        Path(args.json).write_text(json.dumps({"label": label, "peak": result.census.peak,
                                               "parameters": result.parameters, "state": result.state,
                                               "sources": result.census.sources[:50]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
