"""anemoi-layout zarr datasets (read and write), the synthetic dataset, normalisation, training
windows, a resumable sampler and sharded reading."""

from __future__ import annotations

from stormshard.data.anemoi_layout import AnemoiDataset, AnemoiLayoutError, write_anemoi_dataset
from stormshard.data.dataset import ResumableSampler, WindowedSampleDataset, split_by_dates
from stormshard.data.loader import BatchKey, PrefetchLoader, SliceBatchReader, micro_batch_keys
from stormshard.data.normalisation import Normaliser
from stormshard.data.sharded_read import CellShardDataset, ModelSliceReader, SliceReadPlan, gather_cells
from stormshard.data.synthetic import generate_synthetic_dataset

__all__ = [
    "AnemoiDataset", "AnemoiLayoutError", "write_anemoi_dataset", "generate_synthetic_dataset",
    "WindowedSampleDataset", "ResumableSampler", "split_by_dates", "Normaliser", "SliceReadPlan",
    "ModelSliceReader", "CellShardDataset", "gather_cells",
    "PrefetchLoader", "SliceBatchReader", "BatchKey", "micro_batch_keys",
]
