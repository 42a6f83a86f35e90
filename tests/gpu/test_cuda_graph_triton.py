"""The Triton graph-attention kernel on CUDA: forward and gradients against the CPU float64 reference (fp32,
bf16), ``auto``'s choice, forward + backward time against the csr kernel at processor-like sizes, and
training the tiny graph-transformer config with ``graph_kernel: "triton"`` against ``"csr"``. Skipped
without CUDA; times printed with ``-s``.

Tolerances (relative max-norm): fp32 1e-4 (reduction order only), bf16 3e-2 (as tests/test_bf16.py).
"""

from __future__ import annotations

import time

import pytest
import torch

from stormshard.kernels.dispatch import graph_attention_kernel, resolve_graph_kernel
from stormshard.kernels.reference import graph_attention
from tests.gpu.test_cuda_training import _run, dataset  # noqa: F401 - the shared dataset fixture

FP32_TOL, BF16_TOL = 1e-4, 3e-2


def _rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


def _graph(num_src: int, num_dst: int, degree: int, gen: torch.Generator) -> torch.Tensor:
    """``degree`` random sources per destination (some destinations without edges), shuffled."""
    dst = torch.arange(num_dst).repeat_interleave(degree)
    src = torch.randint(0, num_src, (dst.numel(),), generator=gen)
    keep = dst % 7 != 3  # every 7th destination has no edge
    index = torch.stack([src[keep], dst[keep]])
    return index[:, torch.randperm(index.shape[1], generator=gen)]


def _inputs(num_src: int, num_dst: int, heads: int, d: int, feats: int, degree: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    edge_index = _graph(num_src, num_dst, degree, gen)
    e = edge_index.shape[1]
    return [torch.randn(num_dst, heads, d, generator=gen), torch.randn(num_src, heads, d, generator=gen),
            torch.randn(num_src, heads, d, generator=gen), torch.randn(e, feats, generator=gen),
            torch.randn(heads * d, feats, generator=gen) / feats ** 0.5, torch.randn(heads * d, generator=gen),
            edge_index]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_the_float64_reference_on_cuda(dtype):
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    for num_src, num_dst, heads, d, feats, degree in [(500, 300, 16, 64, 3, 12), (257, 257, 3, 24, 7, 16),
                                                      (1000, 80, 1, 8, 1, 40)]:
        *floats, edge_index = _inputs(num_src, num_dst, heads, d, feats, degree, seed=heads)
        nodes = [t.to(dtype).double() for t in floats[:3]]  # the values the bf16 run sees
        ref_in = [t.clone().requires_grad_() for t in nodes + [t.double() for t in floats[3:]]]
        q, k, v, attr, w, b = ref_in
        emb = (attr @ w.T + b).view(-1, heads, d)
        ref = graph_attention(q, k, v, emb, edge_index, num_dst)
        grad = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        ref.backward(grad)
        cuda_in = [t.cuda().to(dtype).requires_grad_() for t in floats[:3]] + \
            [t.cuda().requires_grad_() for t in floats[3:]]  # attributes and weights stay fp32, as under autocast
        out = graph_attention_kernel("triton", *cuda_in, edge_index.cuda(), num_dst)
        assert out.dtype == dtype
        out.backward(grad.cuda().to(dtype))
        for name, a, r in zip(("out", "dq", "dk", "dv", "dattr", "dw", "db"), [out] + [t.grad for t in cuda_in],
                              [ref] + [t.grad for t in ref_in], strict=True):
            err = _rel_max(a.detach().cpu(), r.detach())
            assert err < tol, f"{dtype} heads={heads} d={d} F={feats}: {name} relative error {err:.1e}"


def test_auto_picks_triton_on_cuda_and_times_it_against_csr():
    assert resolve_graph_kernel("auto", "cuda") == "triton"
    assert resolve_graph_kernel("auto", "cuda", torch.bfloat16) == "triton"
    assert resolve_graph_kernel("auto", "cuda", torch.float64) == "csr"  # the reference precision
    # an O48-like processor: 10,944 nodes, KNN 16, 16 heads x 64, bf16 nodes, fp32 attributes (autocast's mix)
    *floats, edge_index = _inputs(10944, 10944, 16, 64, 3, 16, seed=0)
    edge_index = edge_index.cuda()
    times = {}
    for kernel in ("csr", "triton"):
        inputs = [t.cuda().bfloat16().requires_grad_() for t in floats[:3]] + \
            [t.cuda().requires_grad_() for t in floats[3:]]

        def step() -> None:
            graph_attention_kernel(kernel, *inputs, edge_index, 10944).float().square().mean().backward()  # noqa: B023

        step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        tic = time.perf_counter()
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        times[kernel] = ((time.perf_counter() - tic) / 10, torch.cuda.max_memory_allocated() / 2**20)
    print(f"graph attention fwd+bwd, 10,944 nodes x 16 edges, 16 heads x 64, bf16: csr {times['csr'][0] * 1e3:.2f} ms "
          f"({times['csr'][1]:.0f} MiB peak), triton {times['triton'][0] * 1e3:.2f} ms ({times['triton'][1]:.0f} MiB "
          f"peak): {times['csr'][0] / times['triton'][0]:.2f}x")


def test_training_with_triton_matches_csr(dataset, tmp_path):  # noqa: F811
    from tests.tiny_run import tiny_config

    changes = {"engine": "local", "training.max_steps": 10, "training.lr": 3e-3, "deepspeed": {},
               "model.name": "graphtransformer", "graph.processor": {"kind": "knn", "num_neighbours": 6}}
    runs = {}
    for kernel in ("csr", "triton"):
        for precision in ("fp32", "bf16"):
            cfg = tiny_config(dataset, tmp_path / f"{kernel}_{precision}", **changes,
                              **{"training.precision": precision, "model.graph_kernel": kernel})
            runs[kernel, precision] = _run(cfg)
    for precision, tol in (("fp32", 1e-4), ("bf16", 2e-2)):
        a, b = runs["triton", precision]["losses"], runs["csr", precision]["losses"]
        rel = [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]
        print(f"{precision}: triton vs csr loss, mean relative difference {sum(rel) / len(rel):.1e} "
              f"(triton {runs['triton', precision]['seconds']:.1f} s, csr {runs['csr', precision]['seconds']:.1f} s)")
        assert sum(rel) / len(rel) < tol
