import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402
import torch  # noqa: E402

if not torch.cuda.is_available():
    # Triton kernels run in Triton's interpreter on CPU tensors (read when triton.jit decorates, so set
    # before anything imports triton; spawned rank workers inherit it)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.distributed import shutdown_pools  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> str:
    """A synthetic O8 store (64 steps, seed 1), made once for the session: the tiny training runs read it, and
    no test writes into it (one that needs to change a store copies it first)."""
    from stormshard.data.synthetic import generate_synthetic_dataset

    path = tmp_path_factory.mktemp("data") / "synthetic.zarr"
    generate_synthetic_dataset(path, grid="o8", steps=64, seed=1)
    return str(path)


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    shutdown_pools()
