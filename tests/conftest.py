import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402
import torch  # noqa: E402

from tests.distributed import shutdown_pools  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session", autouse=True)
def _close_rank_pools():
    yield
    shutdown_pools()
