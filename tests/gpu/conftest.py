"""GPU-only tests (``make test-gpu`` = ``pytest -m gpu tests``): every test here is marked ``gpu``
and skips without CUDA, so ``make test`` on a CPU machine only reports them as skipped."""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):  # noqa: ANN001
    here = str(__file__).rsplit("/", 1)[0]
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
            if not CUDA:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device (make test-gpu on a GPU machine)"))
