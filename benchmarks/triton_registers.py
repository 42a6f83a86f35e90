"""What ptxas makes of the Triton graph-attention kernels for a GPU, on a machine without one.

    python benchmarks/triton_registers.py [--arch 90] [--heads 16] [--head-dim 64] [--features 3 11]
        [--dtype bf16] [--survey]

Each kernel of :mod:`stormshard.kernels.graph_triton_kernels` is compiled by Triton for the CUDA
architecture ``--arch`` (``triton.compile`` with a ``GPUTarget``: no device is needed) at the launch
configuration :func:`stormshard.kernels.graph_triton.tile_config` picks, and the PTX is assembled
by the ptxas Triton ships with ``-v``: registers per thread, spill bytes, and from them the warps
one SM can hold (65,536 registers, at most 64 warps and 32 programs; registers allocated in units of
8 per thread). ``--survey`` prints the same for other tile shapes (``HP`` heads per program,
``BLOCK_E`` edges per tile, warps) beside the chosen one: the evidence behind ``tile_config`` until a
GPU times them. No timing here: a register and occupancy report, the input of tile choices.

``kernel_resources`` is importable: ``tests/test_graph_triton_compile.py`` compiles every kernel for
sm_80 and sm_90 in each input dtype and holds the chosen tiles free of spills.

Runs with ``TRITON_INTERPRET`` unset (the kernels must be Triton's JIT functions, not interpreted).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: compile, do not interpret
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

REGISTERS_PER_SM = 65536
#: shared memory per SM and the most one program may take, in bytes (sm_80: 164 KiB / 163 KiB; sm_90: 228 / 227 KiB)
SHARED_PER_SM = {80: 167936, 90: 233472}
MAX_SHARED_PER_PROGRAM = {80: 166912, 90: 232448}
MAX_WARPS_PER_SM = 64
MAX_PROGRAMS_PER_SM = 32
_DTYPES = {"bf16": "bf16", "fp16": "fp16", "fp32": "fp32", "fp64": "fp64"}
_INDEX = ("ptr_ptr", "nbr_ptr", "eid_ptr")
_NODE = {"q_ptr", "k_ptr", "v_ptr", "out_ptr", "go_ptr", "dq_ptr", "dk_ptr", "dv_ptr"}


@dataclass(frozen=True)
class Resources:
    """One kernel's compiled resources at one configuration."""

    kernel: str
    registers: int
    spill_bytes: int  # stores + loads
    num_warps: int
    shared_bytes: int = 0  # shared memory per program (Triton's reductions and layout conversions)
    arch: int = 90

    @property
    def resident_warps(self) -> int:
        """Warps one SM holds at once (registers, shared memory, warps and programs per SM)."""
        per_thread = -(-self.registers // 8) * 8
        programs = min(MAX_PROGRAMS_PER_SM, REGISTERS_PER_SM // (per_thread * 32 * self.num_warps),
                       MAX_WARPS_PER_SM // self.num_warps)
        if self.shared_bytes:
            programs = min(programs, SHARED_PER_SM.get(self.arch, SHARED_PER_SM[80]) // self.shared_bytes)
        return programs * self.num_warps

    @property
    def launchable(self) -> bool:
        """Whether one program fits the SM's shared memory (else the launch fails with OutOfResources)."""
        return self.shared_bytes <= MAX_SHARED_PER_PROGRAM.get(self.arch, MAX_SHARED_PER_PROGRAM[80])


def _signature(fn, constants: dict, dtype: str, nodes: frozenset[str] | set[str] = _NODE) -> dict[str, str]:  # noqa: ANN001
    """Triton's signature of ``fn``: node tensors (``nodes``) in ``dtype``, indices int32, every other
    pointer in the accumulation dtype."""
    acc = "fp64" if dtype == "fp64" else "fp32"
    sig = {}
    for name in fn.arg_names:
        if name in constants:
            sig[name] = "constexpr"
        elif name in _INDEX:
            sig[name] = "*i32"
        elif name in nodes:
            sig[name] = "*" + dtype
        elif name.endswith("_ptr"):
            sig[name] = "*" + acc  # attributes, weights and statistics: fp32 (fp64 with fp64 nodes)
        else:
            sig[name] = "i32"
    return sig


class UnsupportedTriton(RuntimeError):
    """This Triton has no ahead-of-time compile API this script knows (``ASTSource(constexprs=...)``,
    ``triton.backends.nvidia.compiler.get_ptxas``): Triton 3.3 or newer has both."""


def _check_triton() -> None:
    import inspect

    import triton
    from triton.compiler import ASTSource

    try:
        from triton.backends.nvidia.compiler import get_ptxas  # noqa: F401
    except ImportError as err:
        raise UnsupportedTriton(f"triton {triton.__version__} has no get_ptxas ({err}): install triton>=3.3") from None
    if "constexprs" not in inspect.signature(ASTSource).parameters:
        raise UnsupportedTriton(f"triton {triton.__version__}'s ASTSource takes no constexprs: install triton>=3.3")


def _ptxas_report(ptx: str, arch: int) -> tuple[int, int]:
    """``(registers, spill bytes)`` from ptxas -v on ``ptx``."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        gpu = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        run = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu}", src, "-o", os.path.join(tmp, "k.o")],
                             capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"ptxas failed: {run.stderr[-2000:]}")
    registers = int(re.search(r"Used (\d+) registers", run.stderr).group(1))
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    return registers, int(spills.group(1)) + int(spills.group(2))


def kernel_resources(heads: int, head_dim: int, features: int, dtype: str = "bf16", arch: int = 90,
                     config: dict[str, int] | None = None, shared: bool = True) -> list[Resources]:
    """The forward, destination-side and source-side kernels compiled for ``sm_<arch>`` at ``config``
    (default: ``tile_config``'s), and the weight-gradient kernel at ``weight_tile_config``'s; node
    tensors in ``dtype``."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from stormshard.kernels import graph_triton_kernels as kernels
    from stormshard.kernels.graph_triton import tile_config, weight_tile_config

    _check_triton()
    if type(kernels.graph_attention_fwd).__name__ == "InterpretedFunction":
        raise RuntimeError("the kernels were imported under TRITON_INTERPRET=1: run this in a process without it")
    cfg = dict(config or tile_config(heads, head_dim, features))
    warps = cfg.pop("num_warps")
    acc = tl.float64 if dtype == "fp64" else tl.float32
    base = dict(H=heads, D=head_dim, F=features, SHARED=shared, ACC=acc, **cfg)
    out = []
    for name, extra in (("fwd", {}), ("bwd_dst", {}), ("bwd_src", {"NEED_DA": True})):
        fn = getattr(kernels, f"graph_attention_{name}")
        constants = {**base, **extra}
        compiled = triton.compile(ASTSource(fn=fn, signature=_signature(fn, constants, _DTYPES[dtype]),
                                            constexprs=constants),
                                  target=GPUTarget("cuda", arch, 32), options=dict(num_warps=warps))
        registers, spills = _ptxas_report(compiled.asm["ptx"], arch)
        out.append(Resources(name, registers, spills, warps, compiled.metadata.shared, arch))
    wcfg = weight_tile_config(features + 1, head_dim)
    wwarps = wcfg.pop("num_warps")
    constants = dict(H=heads, D=head_dim, F1=features + 1, ACC=acc, **wcfg)
    fn = kernels.graph_attention_bwd_weight
    compiled = triton.compile(ASTSource(fn=fn, signature=_signature(fn, constants, _DTYPES[dtype], {"go_ptr", "q_ptr"}),
                                        constexprs=constants),
                              target=GPUTarget("cuda", arch, 32), options=dict(num_warps=wwarps))
    out.append(Resources("bwd_weight", *_ptxas_report(compiled.asm["ptx"], arch), wwarps, compiled.metadata.shared,
                         arch))
    return out


def _row(label: str, res: list[Resources]) -> str:
    cells = "  ".join(f"{r.kernel} {r.registers:3d} regs {r.spill_bytes:4d} B spilled {r.shared_bytes // 1024:3d} KiB "
                      f"shared {r.resident_warps:2d} warps/SM" for r in res)
    return f"{label:38s} {cells}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--features", type=int, nargs="+", default=[3, 11])
    parser.add_argument("--dtype", default="bf16", choices=list(_DTYPES))
    parser.add_argument("--mean-degree", type=float, default=None,
                        help="edges per node of the side a kernel walks (tile_config caps BLOCK_E at it; e.g. 3)")
    parser.add_argument("--survey", action="store_true", help="other tile shapes beside the chosen one")
    parser.add_argument("--quick", action="store_true", help="(the default is quick already)")
    args = parser.parse_args(argv)
    from stormshard.kernels.graph_triton import tile_config

    print(f"sm_{args.arch}, {args.heads} heads x {args.head_dim}, {args.dtype} nodes; resident warps per SM "
          f"of at most {MAX_WARPS_PER_SM}")
    for features in args.features:
        chosen = tile_config(args.heads, args.head_dim, features, args.mean_degree)
        print(f"{features} edge features: chosen HP {chosen['HP']} (G {chosen['G']}), BLOCK_E {chosen['BLOCK_E']}, "
              f"{chosen['num_warps']} warps")
        print(_row("  chosen", kernel_resources(args.heads, args.head_dim, features, args.dtype, args.arch, chosen)))
        if not args.survey:
            continue
        hp_all = 1 << max(args.heads - 1, 0).bit_length()
        for hp in sorted({1, 2, 4, 8, hp_all}):
            if hp > hp_all:
                continue
            for block_e, warps in ((4, 4), (8, 4), (16, 4), (8, 8), (16, 8)):
                cfg = {**chosen, "HP": hp, "G": -(-args.heads // hp), "BLOCK_E": block_e, "num_warps": warps}
                res = kernel_resources(args.heads, args.head_dim, features, args.dtype, args.arch, cfg)
                print(_row(f"  HP {hp:2d} BLOCK_E {block_e:2d} warps {warps}", res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
