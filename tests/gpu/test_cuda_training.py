"""bf16 training of the tiny config on one GPU (local engine with autocast, DeepSpeed bf16 at ZeRO 0
and 1, NCCL world 1, each run in its own process as launch/train.py would). DeepSpeed runs torch's
AdamW (``torch_adam``), so no fused-Adam build is needed (torch's own fused kernel runs on CUDA).
Skipped without CUDA; step times printed with ``-s``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUN = """
import json, sys, time
from stormshard.training.launch import run_training
cfg = json.loads(sys.argv[1])
tic = time.perf_counter()
result = run_training(cfg)
print("RESULT", json.dumps({"losses": result.losses, "seconds": time.perf_counter() - tic}))
"""


def _run(cfg: dict, script: str = RUN, port: int = 29500, **extra_env: str) -> dict:
    """Run ``script`` with ``cfg`` in a fresh one-rank process (NCCL world 1); its ``RESULT`` JSON line."""
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(port + os.getpid() % 1000),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p),
           "DS_ACCELERATOR": "cuda", **extra_env}  # CPU test modules collected in the same session set it to "cpu"
    env = {k: v for k, v in env.items() if v != ""}  # an empty extra value unsets the variable
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(cfg)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> str:
    from stormshard.data.synthetic import generate_synthetic_dataset

    path = tmp_path_factory.mktemp("gpu_data") / "synthetic.zarr"
    generate_synthetic_dataset(path, grid="o8", steps=64, seed=1)
    return str(path)


@pytest.mark.parametrize("engine, stage", [("local", None), ("deepspeed", 0), ("deepspeed", 1)])
def test_bf16_training_on_one_gpu(dataset, tmp_path, engine, stage):
    from tests.tiny_run import tiny_config

    extra = {"deepspeed": {"zero_optimization": {"stage": stage}}} if stage is not None else {"deepspeed": {}}
    changes = {"engine": engine, "training.max_steps": 10, "training.lr": 3e-3, **extra}
    fp32 = _run(tiny_config(dataset, tmp_path / "fp32", **changes))
    bf16 = _run(tiny_config(dataset, tmp_path / "bf16", **changes, **{"training.precision": "bf16"}))
    rel = [abs(a - b) / abs(b) for a, b in zip(bf16["losses"], fp32["losses"], strict=True)]
    print(f"{engine} ZeRO {stage}: fp32 {fp32['seconds']:.1f} s, bf16 {bf16['seconds']:.1f} s for 10 steps "
          f"(with start-up); bf16 vs fp32 loss: mean relative difference {sum(rel) / len(rel):.1e}")
    assert all(map(lambda v: v == v and abs(v) < 1e6, bf16["losses"]))
    assert sum(rel) / len(rel) < 2e-2 and bf16["losses"][-1] < 0.8 * bf16["losses"][0]


def test_adamw_is_fused_on_cuda_and_resumes_on_a_cpu():
    """On CUDA parameters every engine's AdamW is torch's fused kernel: its steps equal the CPU ``foreach``
    path's within 1e-6, and its state dict (the step count on the device) loads into the CPU optimizer and
    steps on from there."""
    import torch

    from stormshard.training.engine.adamw import FlatAdamW, build_adamw

    kwargs = {"lr": 0.01, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}
    torch.manual_seed(0)
    cpu = [torch.nn.Parameter(torch.randn(33, 17)), torch.nn.Parameter(torch.randn(5))]
    gpu = [torch.nn.Parameter(p.detach().cuda()) for p in cpu]
    opt_cpu, opt_gpu = build_adamw(cpu, **kwargs), build_adamw(gpu, **kwargs)
    assert opt_gpu.defaults["fused"] is True and not opt_gpu.defaults["foreach"]
    for _ in range(4):
        grads = [torch.randn_like(p) for p in cpu]
        for params, opt in ((cpu, opt_cpu), (gpu, opt_gpu)):
            for p, g in zip(params, grads, strict=True):
                p.grad = g.to(p.device)
            opt.step()
            opt.zero_grad()
    for a, b in zip(cpu, gpu, strict=True):
        torch.testing.assert_close(a, b.cpu(), rtol=1e-6, atol=1e-6)
    resumed = build_adamw([torch.nn.Parameter(p.detach().cpu()) for p in gpu], **kwargs)
    assert isinstance(resumed, FlatAdamW)
    saved = torch.utils._pytree.tree_map(lambda v: v.cpu() if isinstance(v, torch.Tensor) else v,
                                         opt_gpu.state_dict())  # as a checkpoint loads: map_location="cpu"
    resumed.load_state_dict(saved)
    assert float(resumed.state_dict()["state"][0]["step"]) == 4.0
    resumed.param_groups[0]["params"][0].grad = torch.ones(33, 17)
    resumed.param_groups[0]["params"][1].grad = torch.ones(5)
    resumed.step()
    assert float(resumed.state_dict()["state"][0]["step"]) == 5.0
    assert resumed._flat[id(resumed.param_groups[0])] is not None  # the CPU's flat path, not torch's fused one
    opt_gpu.load_state_dict(resumed.state_dict())  # and back: still fused, the step count on the device
    assert opt_gpu.param_groups[0]["fused"] is True and opt_gpu.state[gpu[0]]["step"].is_cuda


def test_multi_tensor_gradient_checks_on_cuda():
    """DeepSpeed ZeRO's step checks as multi-tensor kernels (``deepspeed_multi_tensor``) on CUDA tensors: float64 norms
    of fp32 / bf16 gradients equal per-tensor norms of float64 copies (to float64 rounding: the CUDA kernel sums
    in another order), and a NaN or an infinity in any tensor is found without a host sync."""
    import torch

    from stormshard.parallel.grads import multi_tensor_norms
    from stormshard.training.engine.deepspeed_multi_tensor import any_non_finite

    torch.manual_seed(0)
    grads = [torch.randn(1 << 20, device="cuda"), torch.randn(513, 7, device="cuda").bfloat16(),
             torch.randn(3, device="cuda")]
    got = multi_tensor_norms(grads, 2.0, dtype=torch.float64)
    for g, t in zip(got, grads, strict=True):
        want = torch.linalg.vector_norm(t.double())
        assert g.dtype == torch.float64 and abs(g.item() - want.item()) <= 1e-12 * want.item()
    assert not any_non_finite(grads, "cuda").item()
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in range(len(grads)):
            broken = [t.clone() for t in grads]
            broken[i].view(-1)[len(broken[i].view(-1)) // 2] = bad
            flag = any_non_finite(broken, "cuda")
            assert flag.is_cuda and flag.item(), (bad, i)
