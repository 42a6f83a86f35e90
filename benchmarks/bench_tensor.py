"""Tensor parallelism vs head sharding vs sequence sharding of the transformer processor, 2 ranks.

For each ``shard_strategy`` of :class:`~stormshard.layers.transformer.TransformerProcessor`
(``tensor``: Megatron tensor + sequence parallelism; ``shard_heads``: all-to-all to heads;
``shard_sequence``: halo exchange) on 2 gloo ranks, 512 channels, it reports per rank:

- parameter memory (the tensor strategy holds half of every big matrix);
- bytes sent per layer in one forward + backward (:class:`CommCounter`), and separately the
  model-group sum of the replicated parameters' gradients after backward
  (``reduce_model_parallel_gradients``: they saw only this rank's tokens): every weight for
  ``shard_heads`` and ``shard_sequence``, only the layer norms and biases for ``tensor``;
- fwd+bwd time (median of interleaved rounds, slowest rank), as a ratio to ``shard_sequence``
  measured in the same run.

Also a single-process fwd+bwd as a reference. CPU and gloo: the times say little about GPUs with
NCCL, the bytes carry over.

    python benchmarks/bench_tensor.py [--quick] [--seq 2048] [--layers 2] [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stormshard.models.parallelize import build_transformer_processor  # noqa: E402
from stormshard.parallel.counter import CommCounter  # noqa: E402
from stormshard.parallel.grads import reduce_model_parallel_gradients  # noqa: E402
from stormshard.parallel.shard import SHARD_STRATEGIES as STRATEGIES  # noqa: E402
from stormshard.parallel.shard import SequenceShard  # noqa: E402

WORLD = 2


def _fwd_bwd(model, x):
    x = x.detach().requires_grad_()
    model(x).square().mean().backward()


def _measure(model, x, group, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        model.zero_grad(set_to_none=True)
        if group is not None:
            dist.barrier(group)
        start = time.perf_counter()
        _fwd_bwd(model, x)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _worker(rank: int, args: argparse.Namespace, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    group = dist.group.WORLD
    shard = SequenceShard.balanced(args.seq, group)
    x_full = torch.randn(1, args.seq, args.channels, generator=torch.Generator().manual_seed(0))
    x = x_full[:, shard.local_slice]
    out, models = {}, {}
    for strategy in STRATEGIES:
        torch.manual_seed(0)
        model = models[strategy] = build_transformer_processor(args.layers, args.channels, args.heads, args.window,
                                                               mlp_ratio=4, shard_strategy=strategy, shard=shard)
        params = sum(p.numel() * p.element_size() for p in model.parameters())
        _fwd_bwd(model, x)  # warm-up
        model.zero_grad(set_to_none=True)
        with CommCounter() as fwd_bwd:
            _fwd_bwd(model, x)
        with CommCounter() as grad_sync:  # replicated weights saw only this rank's tokens: sum them
            reduce_model_parallel_gradients(model.parameters(), group)
        out[strategy] = {"param_bytes": params, "fwd_bwd": fwd_bwd.as_dict(), "fwd_bwd_bytes": fwd_bwd.total_bytes,
                         "grad_sync_bytes": grad_sync.total_bytes, "times": []}
    for _ in range(args.repeats):  # interleaved rounds: load from other processes hits every strategy alike
        for strategy in STRATEGIES:
            out[strategy]["times"].append(_measure(models[strategy], x, group, 1))
    for strategy in STRATEGIES:
        out[strategy]["seconds"] = statistics.median(out[strategy]["times"])
    results.put((rank, out))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="sequence 256, 1 layer, 2 rounds")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--channels", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        args.seq, args.layers, args.repeats = 256, 1, 2

    torch.set_num_threads(1)
    torch.manual_seed(0)
    single = build_transformer_processor(args.layers, args.channels, args.heads, args.window, mlp_ratio=4)
    x = torch.randn(1, args.seq, args.channels)
    _fwd_bwd(single, x)
    single_seconds = _measure(single, x, None, args.repeats)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args, port, results), nprocs=WORLD, start_method="spawn")
    per_rank = dict(results.get() for _ in range(WORLD))
    rows = per_rank[0]
    baseline = max(per_rank[r]["shard_sequence"]["seconds"] for r in range(WORLD))

    print(f"# 2 gloo ranks on CPU, {args.layers} layers, {args.channels} channels, {args.heads} heads, "
          f"window {args.window}, sequence {args.seq} (batch 1, float32); single process fwd+bwd "
          f"{single_seconds:.3f} s")
    print(f"{'strategy':<16}{'params/rank MiB':>16}{'fwd+bwd MiB/layer':>19}{'grad sync MiB/layer':>21}"
          f"{'total MiB/layer':>17}{'fwd+bwd s':>11}{'time ratio':>12}")
    for strategy in STRATEGIES:
        r = rows[strategy]
        seconds = max(per_rank[k][strategy]["seconds"] for k in range(WORLD))  # the slowest rank sets the pace
        per_layer = r["fwd_bwd_bytes"] / args.layers / 2**20
        sync = r["grad_sync_bytes"] / args.layers / 2**20
        print(f"{strategy:<16}{r['param_bytes'] / 2**20:>16.2f}{per_layer:>19.2f}{sync:>21.2f}"
              f"{per_layer + sync:>17.2f}{seconds:>11.3f}{seconds / baseline:>12.2f}")
    print("# collectives per strategy (rank 0, fwd+bwd, all layers):")
    for strategy in STRATEGIES:
        print(f"#   {strategy}: {rows[strategy]['fwd_bwd']}")


if __name__ == "__main__":
    main()
