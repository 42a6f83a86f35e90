"""DeepSpeed's per-step gradient norms, clipping and non-finite check, done by multi-tensor kernels
(``stormshard.training.engine.deepspeed_multi_tensor``), give DeepSpeed's own answers: at ZeRO 1/2 the same
global norm to the bit on a CPU and the same overflow flag, at ZeRO 0 the same clipped gradients to the bit,
at 2 and 4 ranks with model sharding and data parallelism, fp32 and bf16. (The engines' training equivalence
with clipping, ``tests/test_engine.py``, runs with them installed.)"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

from stormshard.parallel.grads import multi_tensor_norms  # noqa: E402
from stormshard.training.engine import build_engine  # noqa: E402
from stormshard.training.engine.deepspeed_multi_tensor import (  # noqa: E402
    any_non_finite,
    install_multi_tensor_steps,
)
from tests.distributed import run_distributed  # noqa: E402
from tests.test_engine import _settings, batch, groups_for, make_model, shard_model, sharded_loss  # noqa: E402


def test_any_non_finite_finds_nan_and_infinities_in_any_dtype():
    finite = [torch.randn(5), torch.randn(3, 4).bfloat16(), torch.randn(2, dtype=torch.float64), torch.empty(0)]
    assert not any_non_finite(finite, "cpu").item()
    assert any_non_finite(finite, "cpu").shape == (1,)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for i in range(3):
            tensors = [t.clone() for t in finite]
            tensors[i].view(-1)[-1] = bad
            assert any_non_finite(tensors, "cpu").item(), (bad, i)
    assert not any_non_finite([], "cpu").item()
    assert not any_non_finite([torch.full((4,), 1e30)], "cpu").item()  # large but finite


def test_multi_tensor_norms_keep_order_and_equal_per_tensor_norms():
    torch.manual_seed(0)
    tensors = [torch.randn(7), torch.randn(3, 3).bfloat16(), torch.randn(11, dtype=torch.float64), torch.randn(2, 5)]
    for ord_ in (1.0, 2.0):
        got = multi_tensor_norms(tensors, ord_, dtype=torch.float64)
        want = [torch.linalg.vector_norm(t.to(torch.float64), ord_) for t in tensors]
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), (got, want)
    assert [n.dtype for n in multi_tensor_norms(tensors, 2.0)] == [t.dtype for t in tensors]


def _check_against_deepspeed(rank: int, world: int, layouts: list[int]) -> list[str]:
    done = []
    for gpus_per_model in layouts:
        groups = groups_for(world, gpus_per_model)
        for stage in (1, 2):
            for precision in ("fp32", "bf16"):
                settings = _settings("deepspeed", stage=stage, accumulation=1, precision=precision)
                local = shard_model(make_model(7), gpus_per_model, groups.model_rank)
                engine = build_engine(local, groups, settings)
                opt = engine.ds.optimizer
                assert set(engine.multi_tensor_steps) == {"clip_fp32_gradients", "get_grad_norm_direct",
                                                          "has_overflow_partitioned_grads_serial"}, engine.multi_tensor_steps
                assert "get_grad_norm_direct" in vars(opt), (stage, precision)
                x, target = batch(0, 4 * groups.layout.data_parallel_size)
                engine.backward(sharded_loss(engine, x, target, groups))
                ours, theirs = opt.get_grad_norm_direct, type(opt).get_grad_norm_direct
                for i in range(len(opt.bit16_groups)):
                    grads, params = opt.averaged_gradients[i], opt.params_in_partition[i]
                    a, b = ours(grads, params), theirs(opt, grads, params)
                    assert torch.equal(a, b) and a.item() > 0, (stage, precision, a, b)
                flag = opt.has_overflow_partitioned_grads_serial
                assert not flag().item() and not type(opt).has_overflow_partitioned_grads_serial(opt).item()
                assert opt.has_overflow() is False  # DeepSpeed's all-reduced flag over the patched check
                grads = [g for g in opt.averaged_gradients[0] if g.numel() and not getattr(g, "_zero_padding", False)]
                for bad in (float("nan"), float("inf")):
                    keep = grads[-1].view(-1)[0].clone()
                    grads[-1].view(-1)[0] = bad
                    assert flag().item() and type(opt).has_overflow_partitioned_grads_serial(opt).item(), bad
                    norm = ours(opt.averaged_gradients[0], opt.params_in_partition[0])
                    assert norm.item() == -1.0  # DeepSpeed's sentinel for a non-finite norm, like its own
                    assert torch.equal(norm, theirs(opt, opt.averaged_gradients[0], opt.params_in_partition[0]))
                    grads[-1].view(-1)[0] = keep
                engine.step()
                done.append(f"{gpus_per_model}:{stage}:{precision}")
    return done


def _check_zero0_clipping(rank: int, world: int, layouts: list[int]) -> list[str]:
    """ZeRO 0, fp32 (where DeepSpeed's engine clips, ``clip_fp32_gradients``): the clipped gradients equal the
    ones DeepSpeed's own method makes from the same gradients, bit for bit, clipping active."""
    done = []
    for gpus_per_model in layouts:
        groups = groups_for(world, gpus_per_model)
        settings = _settings("deepspeed", stage=0, accumulation=1, clip=0.01)
        engine = build_engine(shard_model(make_model(7), gpus_per_model, groups.model_rank), groups, settings)
        assert engine.multi_tensor_steps == ("clip_fp32_gradients",), engine.multi_tensor_steps
        x, target = batch(0, 4 * groups.layout.data_parallel_size)
        engine.backward(sharded_loss(engine, x, target, groups))
        params = [p for p in engine.module.parameters() if p.grad is not None]
        before = [p.grad.clone() for p in params]
        type(engine.ds).clip_fp32_gradients(engine.ds)  # DeepSpeed's
        theirs = [p.grad.clone() for p in params]
        for p, g in zip(params, before, strict=True):
            p.grad.copy_(g)
        engine.ds.clip_fp32_gradients()  # the multi-tensor one
        assert any(not torch.equal(a, b) for a, b in zip(theirs, before, strict=True))  # it clipped
        for a, b in zip(params, theirs, strict=True):
            assert torch.equal(a.grad, b), (a.grad, b)
        engine.step()
        done.append(str(gpus_per_model))
    return done


def test_zero0_clipping_equals_deepspeeds():
    for done in run_distributed(_check_zero0_clipping, 2, [1, 2], timeout=600):
        assert done == ["1", "2"]


@pytest.mark.parametrize("world, layouts", [(2, [1, 2]), (4, [2])])
def test_multi_tensor_checks_give_deepspeeds_answers(world, layouts):
    for done in run_distributed(_check_against_deepspeed, world, layouts, timeout=600):
        assert len(done) == 4 * len(layouts), done


def test_other_engines_are_left_alone():
    model = make_model(0)
    assert install_multi_tensor_steps(model) == () and "clip_fp32_gradients" not in vars(model)
