"""anemoi-layout zarr datasets (read and write), the synthetic dataset, normalisation, training
windows, a resumable sampler and sharded reading."""

from __future__ import annotations

from typing import Any

from stormshard.data.anemoi_layout import AnemoiDataset, AnemoiLayoutError, write_anemoi_dataset
from stormshard.data.dataset import ResumableSampler, WindowedSampleDataset, split_by_dates
from stormshard.data.loader import BatchKey, PrefetchLoader, SliceBatchReader, micro_batch_keys
from stormshard.data.normalisation import Normaliser
from stormshard.data.sharded_read import CellShardDataset, ModelSliceReader, SliceReadPlan, gather_cells

__all__ = [
    "AnemoiDataset", "AnemoiLayoutError", "write_anemoi_dataset", "generate_synthetic_dataset",
    "WindowedSampleDataset", "ResumableSampler", "split_by_dates", "Normaliser", "SliceReadPlan",
    "ModelSliceReader", "CellShardDataset", "gather_cells",
    "PrefetchLoader", "SliceBatchReader", "BatchKey", "micro_batch_keys",
]


def __getattr__(name: str) -> Any:
    # loaded on first use, so that `python -m stormshard.data.synthetic` (make train) runs the module once,
    # without runpy's "found in sys.modules after import of package" warning
    if name == "generate_synthetic_dataset":
        from stormshard.data.synthetic import generate_synthetic_dataset

        return generate_synthetic_dataset
    raise AttributeError(f"module 'stormshard.data' has no attribute {name!r}")
