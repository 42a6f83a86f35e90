# stormshard: one-command setup, tests, lint and the quickstart training job.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.stormshard-installed
NPROC ?= 2

export OMP_NUM_THREADS ?= 1
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export WANDB_MODE ?= offline

.PHONY: setup test test-gpu lint train bench bench-gpu clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PIP) install -q --no-build-isolation "deepspeed>=0.15" torch==2.13.0
	$(PIP) install -q -e ".[dev]" torch==2.13.0
	touch $(STAMP)

test: setup
	$(PY) -m pytest tests

# the GPU suite (tests/gpu/, marker `gpu`): CUDA vs the CPU float64 reference, flash-attn, Transformer
# Engine, bf16 training on one GPU, flex attention, training.compile; every test skips without CUDA. Needs
# a CUDA build of torch (not the CPU wheel `make setup` installs); prints timings. Without the venv:
# make test-gpu PY=python3
test-gpu:
	$(PY) -m pytest -m gpu tests/gpu -s -rs

# the GPU benchmarks: benchmarks/bench_gpu.py (the AIFS-shape processor and the O96 -> O48 model, fp32 / bf16,
# attention kernel banded / flex / flash, compile off / on: step time, peak memory, MFU), then
# benchmarks/bench_gpu_vs_anemoi.py (whole model and graph attention against anemoi-models 0.19, same weights;
# anemoi's interpreter from ANEMOI_PY / ANEMOI_PYTHONPATH or BENCH_VS_ANEMOI_ARGS). Without CUDA each says so and
# exits 0. On a GPU machine without the venv: make test-gpu bench-gpu PY=python3 (benchmarks/gpu_session.sh)
bench-gpu:
	$(PY) benchmarks/bench_gpu.py $(BENCH_GPU_ARGS)
	$(PY) benchmarks/bench_gpu_vs_anemoi.py $(BENCH_VS_ANEMOI_ARGS)

lint: setup
	$(PY) -m ruff check stormshard launch tests benchmarks examples

train: setup
	$(PY) -m stormshard.data.synthetic --grid o16 --steps 600 --out data/synthetic.zarr --if-missing
	DS_ACCELERATOR=cpu $(VENV)/bin/deepspeed --quiet --num_accelerators $(NPROC) launch/train.py --config configs/quickstart.json

bench: setup
	@for b in benchmarks/bench_*.py; do echo "== $$b --quick"; $(PY) $$b --quick || exit 1; done

clean:
	rm -rf $(VENV) .cache .pytest_cache
