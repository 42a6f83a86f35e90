"""The flex-attention window kernel on CUDA: forward and gradients against the banded kernel (with the
halo offsets ``shard_sequence`` passes, rows without keys, head sharding's plain call), the layer's
gradients, ``auto``'s choice, and training the tiny config with ``attention_kernel: "flex"`` against
``"banded"``. Skipped without CUDA; times printed with ``-s``.

Tolerances (relative max-norm): fp32 1e-4 (reduction order only), bf16 3e-2 (as tests/test_bf16.py).
"""

from __future__ import annotations

import time

import pytest
import torch

from stormshard.kernels.dispatch import resolve_attention_kernel, sliding_window_attention
from stormshard.layers.attention import SlidingWindowAttention
from tests.gpu.test_cuda_training import _run, dataset  # noqa: F401 - the shared dataset fixture

FP32_TOL, BF16_TOL = 1e-4, 3e-2


def _rel_max(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_flex_matches_banded_forward_and_gradients(dtype):
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    gen = torch.Generator().manual_seed(0)
    for (lq, lk), window, shift in [((333, 380), 32, 10), ((1001, 1001), 64, 0), ((130, 150), 5, -20),
                                    ((4096, 4096), 512, 0)]:
        base = [torch.randn(2, 4, n, 64, generator=gen) for n in (lq, lk, lk)]
        grad = torch.randn(2, 4, lq, 64, generator=gen).cuda()
        results = {}
        for kernel in ("banded", "flex"):
            q, k, v = (t.cuda().to(dtype).requires_grad_() for t in base)
            out = sliding_window_attention(q, k, v, window, q_offset=shift, kernel=kernel)
            out.backward(grad.to(dtype))
            results[kernel] = (out.detach(), q.grad, k.grad, v.grad)
        for name, a, b in zip(("out", "dq", "dk", "dv"), results["flex"], results["banded"], strict=True):
            err = _rel_max(a, b)
            assert err < tol, f"{dtype} lq={lq} lk={lk} w={window} shift={shift}: {name} relative error {err:.1e}"


def test_auto_picks_flex_on_cuda_and_the_layer_trains_with_it():
    q = torch.randn(1, 2, 64, 32, device="cuda")
    # bf16 / fp16: flash where importable, else flex; fp32 and head dims under 16: banded (measured faster)
    assert resolve_attention_kernel("auto", q.bfloat16(), q.bfloat16(), q.bfloat16(), 0, 8) in ("flex", "flash")
    assert resolve_attention_kernel("auto", q, q, q, 0, 8) == "banded"
    small = torch.randn(1, 2, 64, 8, device="cuda", dtype=torch.bfloat16)
    assert resolve_attention_kernel("auto", small, small, small, 0, 8) in ("banded", "flash")
    torch.manual_seed(0)
    layers = {k: SlidingWindowAttention(256, 4, 100, attention_kernel=k).cuda() for k in ("banded", "flex")}
    layers["flex"].load_state_dict(layers["banded"].state_dict())
    x = torch.randn(2, 2000, 256, device="cuda")
    grads, times = {}, {}
    for kernel, layer in layers.items():
        xi = x.clone().requires_grad_()
        layer(xi).square().mean().backward()
        torch.cuda.synchronize()
        tic = time.perf_counter()
        for _ in range(5):
            layer(xi).square().mean().backward()
        torch.cuda.synchronize()
        times[kernel] = (time.perf_counter() - tic) / 5
        layer.zero_grad()
        xi.grad = None
        layer(xi).square().mean().backward()
        grads[kernel] = [xi.grad] + [p.grad for p in layer.parameters()]
    for a, b in zip(grads["flex"], grads["banded"], strict=True):
        assert _rel_max(a, b) < FP32_TOL
    print(f"layer forward+backward, 2000 tokens, window 100, fp32: banded {times['banded'] * 1e3:.2f} ms, "
          f"flex {times['flex'] * 1e3:.2f} ms")


def test_training_with_flex_matches_banded(dataset, tmp_path):  # noqa: F811
    from tests.tiny_run import tiny_config

    # head dim 16 (flex's Triton kernels need at least 16): 32 channels over 2 heads
    changes = {"engine": "local", "training.max_steps": 10, "training.lr": 3e-3, "deepspeed": {},
               "model.num_channels": 32, "model.processor.num_heads": 2}
    runs = {}
    for kernel in ("banded", "flex"):
        for precision in ("fp32", "bf16"):
            cfg = tiny_config(dataset, tmp_path / f"{kernel}_{precision}", **changes,
                              **{"training.precision": precision, "model.processor.attention_kernel": kernel})
            runs[kernel, precision] = _run(cfg)
    for precision, tol in (("fp32", 1e-4), ("bf16", 2e-2)):
        a, b = runs["flex", precision]["losses"], runs["banded", precision]["losses"]
        rel = [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]
        print(f"{precision}: flex vs banded loss, mean relative difference {sum(rel) / len(rel):.1e} "
              f"(flex {runs['flex', precision]['seconds']:.1f} s, banded {runs['banded', precision]['seconds']:.1f} s)")
        assert sum(rel) / len(rel) < tol


def test_selective_checkpointing_keeps_flex_output_in_compiled_blocks():
    """Compiled processor blocks (flex, bf16 autocast) with selective checkpointing give the gradients of full
    checkpointing and launch fewer flex kernels: the recompute takes flex's kept output (torch's selective
    checkpointing sees flex's higher-order operator), so each layer's flex forward runs once, not twice."""
    from torch.profiler import ProfilerActivity, profile

    from stormshard.models.parallelize import build_transformer_processor

    x = torch.randn(1, 3000, 256, device="cuda")
    results, times, flex_kernels = {}, {}, {}
    for mode in (True, "selective"):
        torch.manual_seed(0)
        proc = build_transformer_processor(2, 256, 4, 200, activation_checkpointing=mode, attention_kernel="flex").cuda()
        for block in proc.blocks:
            block.compile(fullgraph=True)

        def step(proc=proc):  # noqa: ANN202
            xi = x.clone().requires_grad_()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = proc(xi)
            out.float().square().mean().backward()
            return out.detach().float(), xi.grad, [p.grad.clone() for p in proc.parameters()]

        step()  # compiles
        proc.zero_grad()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            results[mode] = step()
            torch.cuda.synchronize()
        flex_kernels[mode] = sum(e.count for e in prof.key_averages() if "flex" in e.key or "triton_tem" in e.key)
        proc.zero_grad()
        tic = time.perf_counter()
        for _ in range(5):
            step()
            proc.zero_grad()
        torch.cuda.synchronize()
        times[mode] = (time.perf_counter() - tic) / 5
    for a, b in zip((results["selective"][0], results["selective"][1], *results["selective"][2]),
                    (results[True][0], results[True][1], *results[True][2]), strict=True):
        assert _rel_max(a, b) < BF16_TOL
    print(f"processor 2 layers x 3000 tokens, 256 ch, window 200, compiled, bf16: full {times[True] * 1e3:.2f} ms, "
          f"selective {times['selective'] * 1e3:.2f} ms per step; flex/template kernels {flex_kernels}")
    assert 0 < flex_kernels["selective"] < flex_kernels[True]
