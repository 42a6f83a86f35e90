"""PowerSGD vs exact all-reduce vs torch's DDP PowerSGD hook: bytes, all-reduce calls and step time.

Runs on 2 gloo ranks (CPU) a stack of large linears (default 16 x Linear(1024, 1024): 16.8 M
parameters) and times, per variant, one training step (forward, backward, gradient reduction)
and, where the reduction is a separate call, the reduction alone:

- ``exact``: plain model + :func:`exact_allreduce_gradients` (one flat all-reduce) - the baseline;
- ``powersgd``: plain model + :class:`PowerSGDCompressor` (3 batched all-reduces per step);
- ``ddp``: torch DDP with the default all-reduce hook (one all-reduce per 25 MB bucket);
- ``ddp+torch-powersgd``: DDP + ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``
  (one bucket for the whole model: with several buckets it hit a collective mismatch on gloo);
- ``ddp+powersgd``: DDP + :func:`register_powersgd_hook` (ours, buckets deferred to one reduction).

Bytes and calls are measured by wrapping ``torch.distributed.all_reduce`` (bytes a rank sends in
a ring all-reduce: ``2 (w-1)/w`` of the buffer), the same way for every variant.

    python benchmarks/bench_compression.py [--quick] [--rank 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stormshard.parallel.compression import (  # noqa: E402
    PowerSGDCompressor,
    PowerSGDConfig,
    exact_allreduce_gradients,
    register_powersgd_hook,
)
from stormshard.parallel.counter import CommCounter  # noqa: E402

_TALLY = {"calls": 0, "bytes": 0}
_ORIGINAL_ALL_REDUCE = dist.all_reduce


def _counting_all_reduce(tensor, *args, **kwargs):
    world = dist.get_world_size(kwargs.get("group"))
    _TALLY["calls"] += 1
    _TALLY["bytes"] += tensor.numel() * tensor.element_size() * 2 * (world - 1) // world
    return _ORIGINAL_ALL_REDUCE(tensor, *args, **kwargs)


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks)


def _run_variant(name, rank, world, args, cfg):
    model = _model(args.layers, args.width)
    reduce = None
    comp = None
    if name == "exact":
        def reduce():
            exact_allreduce_gradients(model.parameters(), dist.group.WORLD)
    elif name == "powersgd":
        comp = PowerSGDCompressor(model.parameters(), dist.group.WORLD, cfg)
        reduce = comp.reduce_gradients
    else:
        # torch's hook chains each bucket's all-reduces in future callbacks; with several buckets
        # in flight on gloo the ranks issued them in different orders (collective mismatch), so
        # it gets one bucket holding the whole model (its best case: 3 calls per step)
        whole_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20 + 1
        bucket_mb = whole_mb if name == "ddp+torch-powersgd" else 25
        ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_mb)
        if name == "ddp":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(dist.group.WORLD, default_hooks.allreduce_hook)
        elif name == "ddp+torch-powersgd":
            from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

            state = powerSGD_hook.PowerSGDState(
                process_group=dist.group.WORLD, matrix_approximation_rank=cfg.rank,
                start_powerSGD_iter=2, min_compression_rate=cfg.min_compression_rate,
                use_error_feedback=True, warm_start=True, orthogonalization_epsilon=cfg.orthogonalisation_eps,
            )
            ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        elif name == "ddp+powersgd":
            comp = register_powersgd_hook(ddp, cfg).compressor
        model = ddp
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(args.batch, args.width, generator=gen)
    step_times, reduce_times = [], []
    tally = None
    for step in range(args.warmup + args.steps):
        model.zero_grad(set_to_none=True)
        dist.barrier()
        _TALLY.update(calls=0, bytes=0)
        with CommCounter() as counter:
            t0 = time.perf_counter()
            model(x).square().mean().backward()
            t1 = time.perf_counter()
            if reduce is not None:
                reduce()
            t2 = time.perf_counter()
        if step >= args.warmup:
            step_times.append(t2 - t0)
            reduce_times.append(t2 - t1)
            tally = dict(_TALLY)
            if comp is not None and counter.bytes("all_reduce") != tally["bytes"]:
                raise RuntimeError(f"{name}: CommCounter {counter.as_dict()} disagrees with the wrapper {tally}")
    return {
        "step_s": statistics.median(step_times),
        "reduce_s": statistics.median(reduce_times) if reduce is not None else None,
        "calls": tally["calls"],
        "bytes": tally["bytes"],
    }


def _worker(rank, world, port, args, queue):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    dist.all_reduce = _counting_all_reduce
    cfg = PowerSGDConfig(rank=args.rank, start_iter=0, min_numel=4096)
    results = {}
    for name in ("exact", "powersgd", "ddp", "ddp+torch-powersgd", "ddp+powersgd"):
        results[name] = _run_variant(name, rank, world, args, cfg)
    if rank == 0:
        params = sum(p.numel() for p in _model(args.layers, args.width).parameters())
        comp = PowerSGDCompressor(_model(args.layers, args.width).parameters(), dist.group.WORLD, cfg)
        queue.put({"params": params, "estimate": comp.bytes_per_step().__dict__, "results": results})
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 x Linear(512, 512), 3 timed steps")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=64, help="rows per rank")
    parser.add_argument("--rank", type=int, default=4, help="PowerSGD rank")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--json", default=None, help="write the numbers to this file")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.width, args.steps, args.warmup = 4, 512, 3, 3
    world = 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, args, queue)) for r in range(world)]
    for p in procs:
        p.start()
    out = queue.get(timeout=1800)
    for p in procs:
        p.join()
    res = out["results"]
    base = res["exact"]
    print(f"PowerSGD benchmark: {args.layers} x Linear({args.width}, {args.width}) = {out['params'] / 1e6:.1f} M params, "
          f"rank {args.rank}, batch {args.batch}/rank, {world} gloo ranks, {args.threads} thread(s) each "
          "(shared 2-core CPU: times are indicative)")
    print(f"{'variant':<20} {'calls/step':>10} {'MB sent/step':>13} {'bytes vs exact':>15} "
          f"{'step ms':>9} {'step vs exact':>14} {'reduce ms':>10}")
    for name, r in res.items():
        reduce_ms = f"{1e3 * r['reduce_s']:10.1f}" if r["reduce_s"] is not None else f"{'(in bwd)':>10}"
        print(f"{name:<20} {r['calls']:>10d} {r['bytes'] / 2**20:>13.2f} {base['bytes'] / max(r['bytes'], 1):>14.1f}x "
              f"{1e3 * r['step_s']:>9.1f} {base['step_s'] / r['step_s']:>13.2f}x {reduce_ms}")
    ratio_reduce = base["reduce_s"] / res["powersgd"]["reduce_s"]
    print(f"reduction time exact / powersgd: {ratio_reduce:.2f}x (>1: PowerSGD reduces faster); "
          f"estimate bytes_per_step(): {out['estimate']['compressed'] / 2**20:.2f} MB vs {out['estimate']['exact'] / 2**20:.2f} MB")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **out}, f, indent=2)


if __name__ == "__main__":
    main()
