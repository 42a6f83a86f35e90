"""Benchmark sliding-window attention: kernel vs dense SDPA, shard_sequence vs shard_heads, halo transport.

    python benchmarks/bench_attention.py            # the issue's sizes (several minutes on 2 cores)
    python benchmarks/bench_attention.py --quick    # small sizes, well under a minute

1. The banded window kernel vs ``F.scaled_dot_product_attention`` with a dense boolean band mask,
   single process, forward + backward, ``(1, 16 heads, seq, 64)`` float32, window 512, at
   sequence 4k, 8k, 16k: times, the dense/banded ratio and each one's growth per doubling.
2. A 4-layer :class:`TransformerProcessor` on 2 gloo ranks at an O48-like sequence (10,944
   tokens), 256 channels, 16 heads, window 512: forward + backward time per strategy, the
   ratio, and bytes sent per rank per layer from :class:`CommCounter`.
3. The halo exchange's two transports (one ``all_to_all_single`` vs batched ``isend``/``irecv``)
   on 2 and 4 ranks: time per forward + backward exchange.
4. The layer's q, k, v split: :class:`SlidingWindowAttention` (q, k, v views of ``lin_qkv``'s output,
   :func:`~stormshard.layers.attention.split_qkv`) against the same layer splitting by indexing a
   ``three``-first rearrangement (the baseline: what the layer did before; its backward zero-fills three
   ``qkv``-sized gradients), forward + backward at the processor's sequence and channels, float32, the
   banded kernel (a CPU's); gradients compared bit for bit. On CUDA flex also skips its copies of q, k, v
   and of its output (``benchmarks/step_census.py --cuda-path``).

Every ratio compares numbers measured in the same run. Timings are the minimum over repeats
after one warm-up (none for the dense 16k case, which runs once).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import socket
import sys
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stormshard.kernels.dispatch import sliding_window_attention  # noqa: E402
from stormshard.layers.attention import SlidingWindowAttention  # noqa: E402
from stormshard.layers.transformer import TransformerProcessor  # noqa: E402
from stormshard.parallel.counter import CommCounter  # noqa: E402
from stormshard.parallel.sequence import halo_exchange  # noqa: E402
from stormshard.parallel.shapes import balanced_sizes  # noqa: E402
from stormshard.parallel.shard import SequenceShard  # noqa: E402


@dataclass(frozen=True)
class Sizes:
    kernel_seqs: tuple[int, ...]
    kernel_heads: int
    kernel_dim: int
    kernel_window: int
    proc_seq: int
    proc_channels: int
    proc_heads: int
    proc_layers: int
    proc_window: int
    halo_seq: int
    halo_window: int
    repeats: int


FULL = Sizes((4096, 8192, 16384), 16, 64, 512, 10_944, 256, 16, 4, 512, 10_944, 512, 3)
QUICK = Sizes((1024, 2048, 4096), 4, 32, 128, 2_736, 64, 8, 2, 128, 2_736, 128, 1)


def _timed(fn, repeats: int, warmup: bool = True) -> float:
    if warmup:
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


# ------------------------------------------------------------------------------------------
# 1. kernel vs dense SDPA
# ------------------------------------------------------------------------------------------


def bench_kernel(sizes: Sizes) -> None:
    print(f"\n1. window kernel vs dense-mask SDPA, fwd+bwd, (1, {sizes.kernel_heads}, seq, {sizes.kernel_dim}) "
          f"float32, window {sizes.kernel_window}, {torch.get_num_threads()} threads")
    print(f"{'seq':>7} {'banded s':>10} {'dense s':>10} {'dense/banded':>13} {'banded x':>9} {'dense x':>8}")
    previous = None
    for seq in sizes.kernel_seqs:
        q, k, v = (torch.randn(1, sizes.kernel_heads, seq, sizes.kernel_dim, requires_grad=True) for _ in range(3))
        pos = torch.arange(seq)
        mask = (pos[:, None] - pos[None, :]).abs() <= sizes.kernel_window

        def banded(q=q, k=k, v=v):
            sliding_window_attention(q, k, v, sizes.kernel_window).sum().backward()

        def dense(q=q, k=k, v=v, mask=mask):
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()

        t_band = _timed(banded, sizes.repeats)
        big = seq >= 16384
        t_dense = _timed(dense, 1 if big else sizes.repeats, warmup=not big)
        growth = ("" if previous is None else
                  f"{t_band / previous[0]:>9.2f} {t_dense / previous[1]:>8.2f}")
        print(f"{seq:>7} {t_band:>10.3f} {t_dense:>10.3f} {t_dense / t_band:>13.2f} {growth}")
        previous = (t_band, t_dense)
    print("   (banded x / dense x: time growth since the previous sequence, which doubles: 2 = linear, 4 = quadratic)")


# ------------------------------------------------------------------------------------------
# 2 and 3. distributed parts (gloo ranks, one thread each)
# ------------------------------------------------------------------------------------------


def _processor_job(rank: int, world: int, sizes: Sizes) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD
    shard = SequenceShard.balanced(sizes.proc_seq, group)
    x = torch.randn(1, shard.local_size, sizes.proc_channels, requires_grad=True)
    steps, result = {}, {}
    for strategy in ("shard_sequence", "shard_heads"):
        torch.manual_seed(0)
        proc = TransformerProcessor(sizes.proc_layers, sizes.proc_channels, sizes.proc_heads, sizes.proc_window,
                                    shard_strategy=strategy, shard=shard)

        def step(proc=proc):
            proc(x).sum().backward()
            dist.barrier(group)

        with CommCounter() as counter:
            step()  # also the warm-up
        steps[strategy] = step
        result[strategy] = {"seconds": float("inf"), "bytes_per_layer": counter.total_bytes / sizes.proc_layers,
                            "calls": counter.as_dict()}
    for _ in range(sizes.repeats):  # alternate the strategies so both see the same machine load
        for strategy, step in steps.items():
            result[strategy]["seconds"] = min(result[strategy]["seconds"], _timed(step, 1, warmup=False))
    return result


def _halo_job(rank: int, world: int, sizes: Sizes) -> dict:
    import torch.distributed as dist

    group = dist.group.WORLD
    shard = balanced_sizes(sizes.halo_seq, world)
    x = torch.randn(1, shard[rank], sizes.proc_channels, requires_grad=True)
    iterations = 20 if sizes.repeats > 1 else 5
    timings = {"all_to_all": [], "p2p": []}
    for _ in range(3):  # alternate the transports to share the machine's noise
        for method in timings:
            def step(method=method):
                for _ in range(iterations):
                    halo_exchange(x, sizes.halo_window, group, shard, method=method).sum().backward()
                dist.barrier(group)

            timings[method].append(_timed(step, 1, warmup=False) / iterations)
    return {method: min(ts) for method, ts in timings.items()}


def _worker(rank: int, world: int, port: int, job: str, sizes: Sizes, queue) -> None:  # noqa: ANN001
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = {"processor": _processor_job, "halo": _halo_job}[job](rank, world, sizes)
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def _spawn(job: str, world: int, sizes: Sizes) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, job, sizes, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = dict(queue.get() for _ in range(world))
    for p in procs:
        p.join()
    return [results[r] for r in range(world)]


def bench_processor(sizes: Sizes) -> None:
    print(f"\n2. {sizes.proc_layers}-layer processor, fwd+bwd on 2 ranks (1 thread each), seq {sizes.proc_seq}, "
          f"{sizes.proc_channels} channels, {sizes.proc_heads} heads, window {sizes.proc_window}, float32")
    results = _spawn("processor", 2, sizes)
    print(f"{'strategy':>15} {'seconds':>9} {'MB sent/rank/layer (rank 0, rank 1)':>38}")
    for strategy in ("shard_sequence", "shard_heads"):
        secs = max(r[strategy]["seconds"] for r in results)
        mb = ", ".join(f"{r[strategy]['bytes_per_layer'] / 1e6:.2f}" for r in results)
        print(f"{strategy:>15} {secs:>9.3f} {mb:>38}")
    seq_s = max(r["shard_sequence"]["seconds"] for r in results)
    heads_s = max(r["shard_heads"]["seconds"] for r in results)
    seq_b = max(r["shard_sequence"]["bytes_per_layer"] for r in results)
    heads_b = max(r["shard_heads"]["bytes_per_layer"] for r in results)
    print(f"   shard_heads / shard_sequence: time {heads_s / seq_s:.2f}x, bytes {heads_b / seq_b:.1f}x")
    print(f"   calls rank 0: shard_sequence {results[0]['shard_sequence']['calls']}, "
          f"shard_heads {results[0]['shard_heads']['calls']}")


def bench_halo(sizes: Sizes) -> None:
    print(f"\n3. halo exchange transports, fwd+bwd of (1, seq/ranks, {sizes.proc_channels}) float32, seq "
          f"{sizes.halo_seq}, halo {sizes.halo_window}")
    print(f"{'ranks':>6} {'all_to_all ms':>14} {'p2p ms':>8} {'p2p/all_to_all':>15}")
    for world in (2, 4):
        results = _spawn("halo", world, sizes)
        a2a = max(r["all_to_all"] for r in results) * 1e3
        p2p = max(r["p2p"] for r in results) * 1e3
        print(f"{world:>6} {a2a:>14.3f} {p2p:>8.3f} {p2p / a2a:>15.2f}")


# ------------------------------------------------------------------------------------------
# 4. the q, k, v split: views against index-and-copy
# ------------------------------------------------------------------------------------------


class _IndexedSplitAttention(SlidingWindowAttention):
    """The baseline: q, k, v by indexing a ``three``-first rearrangement of ``lin_qkv``'s output."""

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv = self.lin_qkv(x).unflatten(-1, (self.num_heads, 3, self.head_dim)).permute(3, 0, 2, 1, 4)
        return qkv[0], qkv[1], qkv[2]


def bench_split(sizes: Sizes) -> None:
    channels, heads, window, seq = sizes.proc_channels, sizes.proc_heads, sizes.proc_window, sizes.proc_seq
    print(f"\n4. the layer's q, k, v split, fwd+bwd, (1, {seq}, {channels}) float32, {heads} heads, window {window}, "
          f"banded kernel, {torch.get_num_threads()} threads")
    torch.manual_seed(0)
    views = SlidingWindowAttention(channels, heads, window, attention_kernel="banded")
    indexed = _IndexedSplitAttention(channels, heads, window, attention_kernel="banded")
    indexed.load_state_dict(views.state_dict())
    x = torch.randn(1, seq, channels)

    def step(layer: SlidingWindowAttention) -> torch.Tensor:
        xi = x.clone().requires_grad_()
        layer(xi).square().mean().backward()
        return xi.grad

    same = torch.equal(step(views), step(indexed))
    t_views, t_indexed = _timed(lambda: step(views), sizes.repeats + 2), _timed(lambda: step(indexed), sizes.repeats + 2)
    print(f"  views (split_qkv) {t_views:.3f} s, indexed (baseline) {t_indexed:.3f} s, speed-up {t_indexed / t_views:.2f}x; "
          f"input gradients bit-identical: {same}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes for a fast smoke run")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads for the single-process part (1: stable on a shared machine)")
    parser.add_argument("--only", choices=("kernel", "processor", "halo", "split"), help="run one part")
    args = parser.parse_args()
    sizes = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(f"stormshard bench_attention ({'quick' if args.quick else 'full'}), torch {torch.__version__}, "
          f"{os.cpu_count()} CPUs (numbers from a shared machine are noisy)")
    if args.only in (None, "kernel"):
        bench_kernel(sizes)
    if args.only in (None, "halo"):
        bench_halo(sizes)
    if args.only in (None, "processor"):
        bench_processor(sizes)
    if args.only in (None, "split"):
        bench_split(sizes)


if __name__ == "__main__":
    main()
