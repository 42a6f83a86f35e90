#!/usr/bin/env bash
# One prepared device call on a lent GPU machine (issue 31): anemoi's wheels, `make test-gpu`, the step census
# (the profile of casts, sorts and host syncs), then `make bench-gpu` (benchmarks/bench_gpu.py, the processor
# MFU row, and benchmarks/bench_gpu_vs_anemoi.py, the head-to-head with anemoi-models 0.19), all inside a total
# budget. Logs go to $OUT (the device tool's output folder; they come back) or benchmarks/results/gpu_session_<time>/.
#
# The GPU machine has python3 with torch, triton and torch-geometric but no package index, so fetch anemoi's
# wheels here first (13 MB; keep them out of git) and carry them:
#
#   ../shared/gpu/fetch_anemoi_wheels.sh .whl && echo /.whl/ >> .git/info/exclude
#   device run: command "bash benchmarks/gpu_session.sh 540", carry [".whl"], timeout_s 600
#
# Budget (seconds, default 540): the GPU tests of the new kernels and layouts (tests/gpu/test_cuda_graph_triton.py,
# test_cuda_layers.py and test_cuda_flex.py: flex reads q, k, v as views of the projection, compiled blocks keep
# flex's output under selective checkpointing) up to 200, the census up
# to 30 (casts, copies, sorts and host syncs of a small graph-transformer step; a dispatch mode cannot watch flex's
# compiled call, so the window attention's copies are counted on fake tensors: step_census.py --cuda-path), then
# make bench-gpu with what is left but 60 s (about 300 s), then the rest of `make test-gpu` in what remains (a full
# make test-gpu takes 5-6 min: run it in a second session if it is cut): bench_gpu.py's bf16 compiled flex processor rows (--budget-s 30, about 40 s) and
# bench_gpu_vs_anemoi.py --quick with --budget-s = what is left - 170 (a row started before that runs to its end:
# the AIFS-size compiled rows, the defaults' and selective checkpointing's, compile for a minute or two each; O96
# also gets a "compiled + CUDA graphs" row, and every
# stormshard row one more step under the allocator's history: what holds memory at its peak). Last, inside what is left, the tile table times the Triton
# graph kernel at four other tile shapes (--triton-tiles: 4 nodes per program, one after the other, with 4-edge tiles
# on 4 warps, for the 3-edge nodes of the decoder and of the encoder's source-side backward; 4 heads x 8 edges on 8
# warps everywhere, the choice before tiles were capped at the mean degree; 2 heads x 8 edges on 8 warps and 2 heads
# x 4 edges on 4 warps, which hold 16-36 warps per SM under this machine's Triton 3.6 where tile_config's 4 heads
# hold 8-16 at 11 edge features) beside tile_config's. Estimated on an H100: O96 rows ~100 s, the
# attention table ~60 s, the AIFS rows ~200 s. Each step runs under `timeout`; a failed step is logged and the
# next one runs. Without .whl/ the anemoi rows are skipped (the script says why) and stormshard's rows still run.
set -uo pipefail
TOTAL=${1:-540}
PY=${PY:-python3}
START=$(date +%s)
LOG=${OUT:-benchmarks/results/gpu_session_$(date +%Y%m%d_%H%M%S)}
mkdir -p "$LOG"
export PYTHONUNBUFFERED=1

left() { echo $(( TOTAL - ($(date +%s) - START) )); }
say() { echo "$*" | tee -a "$LOG/session.log"; }

# run_step NAME SECONDS COMMAND...: the command under timeout, its output in $LOG/NAME.log, its tail shown
run_step() {
  local name=$1 secs=$2 t0 rc
  shift 2
  if (( secs < 20 )); then say "== $name: skipped ($(left) s of the budget left)"; return 0; fi
  say "== $name (up to $secs s; $(left) s of $TOTAL left): $*"
  t0=$(date +%s)
  timeout -k 15 "$secs" "$@" > "$LOG/$name.log" 2>&1
  rc=$?
  say "== $name: exit $rc after $(( $(date +%s) - t0 )) s$([ $rc = 124 ] && echo ' (timed out)')"
  tail -n "${TAIL:-15}" "$LOG/$name.log"
}

# anemoi-models and its dependencies (pip --target, never into the machine's python), the checkout on the path
ANEMOI=(--anemoi-python none)
export PYTHONPATH=$PWD
if ! compgen -G ".whl/*.whl" > /dev/null && [ -f ../shared/gpu/fetch_anemoi_wheels.sh ]; then
  say "no .whl/: trying ../shared/gpu/fetch_anemoi_wheels.sh .whl (needs a package index)"
  PIP_RETRIES=0 PIP_TIMEOUT=10 timeout 90 bash ../shared/gpu/fetch_anemoi_wheels.sh .whl >> "$LOG/session.log" 2>&1 \
    || say "fetching the wheels failed (no index here?)"
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl/*.whl >> "$LOG/session.log" 2>&1; then
    export PYTHONPATH=/tmp/site:$PWD  # as ../shared/gpu/fetch_anemoi_wheels.sh says (zarr for stormshard's data too)
    ANEMOI=(--anemoi-python "$PY" --anemoi-pythonpath /tmp/site)
    say "anemoi wheels installed into /tmp/site ($(ls .whl/*.whl | wc -l) wheels)"
  else
    say "installing .whl/*.whl failed (see above): anemoi rows skipped"
  fi
else
  say "no .whl/ here: anemoi rows skipped (fetch them on a machine with an index: ../shared/gpu/fetch_anemoi_wheels.sh .whl, then carry .whl)"
fi

{
  echo "# gpu_session.sh, $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.cuda.is_available())" 2>&1
  "$PY" -c "import anemoi.models; print('anemoi-models', anemoi.models.__version__)" 2>&1 | tail -1
} | tee -a "$LOG/session.log"

# the new kernels first (a full `make test-gpu` takes 5-6 min on an H100: it runs last, in what is left)
run_step test_gpu_kernels 200 "$PY" -m pytest -m gpu tests/gpu/test_cuda_graph_triton.py tests/gpu/test_cuda_layers.py \
  tests/gpu/test_cuda_flex.py -s -rs -q
run_step census 30 "$PY" benchmarks/step_census.py --device cuda
VS_BUDGET=$(( $(left) - 170 ))
TAIL=60 run_step bench_gpu $(( $(left) - 60 )) make bench-gpu PY="$PY" \
  BENCH_GPU_ARGS="--quick --tables processor --rows bf16/flex/on --budget-s 30 --json $LOG/bench_gpu.json" \
  BENCH_VS_ANEMOI_ARGS="--quick ${ANEMOI[*]} --budget-s $VS_BUDGET --memory-census --tables model:o96,attention:aifs,model:aifs,tiles:aifs --triton-tiles 4x4x4x4,4x8x8,2x8x8,2x4x4 --json $LOG/bench_gpu_vs_anemoi.json"
run_step test_gpu_rest $(( $(left) - 10 )) "$PY" -m pytest -m gpu tests/gpu -s -rs -q \
  --deselect tests/gpu/test_cuda_graph_triton.py --deselect tests/gpu/test_cuda_layers.py \
  --deselect tests/gpu/test_cuda_flex.py

say "== the head-to-head (from $LOG/bench_gpu.log)"
grep -E '^\| |^(o96|aifs|encoder|processor|decoder): |^device: |^anemoi|^peak |^  +[0-9.]+ GiB' "$LOG/bench_gpu.log" | grep -v '^| case' \
  | tee "$LOG/summary.txt"
say "== done in $(( $(date +%s) - START )) s; logs in $LOG"
