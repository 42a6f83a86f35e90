"""anemoi-layout zarr datasets (read and write), the synthetic dataset, normalisation, training
windows, a resumable sampler and sharded reading."""

from __future__ import annotations

from stormshard.data.anemoi_layout import (  # noqa: F401
    LAYOUT_VERSION,
    AnemoiDataset,
    AnemoiLayoutError,
    Statistics,
    as_datetime64,
    compute_statistics,
    frequency_to_string,
    parse_frequency,
    write_anemoi_dataset,
)
from stormshard.data.dataset import (  # noqa: F401
    ResumableSampler,
    WindowedSampleDataset,
    split_by_dates,
    split_sample,
)
from stormshard.data.normalisation import (  # noqa: F401
    METHODS,
    Normaliser,
)
from stormshard.data.sharded_read import (  # noqa: F401
    CellShard,
    CellShardDataset,
    cell_shard,
    gather_cells,
    read_sample_sharded,
)
from stormshard.data.synthetic import (  # noqa: F401
    DIAGNOSTIC,
    FORCING,
    PROGNOSTIC,
    VARIABLES,
    SyntheticDynamics,
    generate_synthetic_dataset,
    insolation,
    rotation_matrix,
    unit_vectors,
)

__all__ = [
    "AnemoiLayoutError",
    "Statistics",
    "AnemoiDataset",
    "compute_statistics",
    "write_anemoi_dataset",
    "parse_frequency",
    "frequency_to_string",
    "as_datetime64",
    "LAYOUT_VERSION",
    "WindowedSampleDataset",
    "split_sample",
    "split_by_dates",
    "ResumableSampler",
    "METHODS",
    "Normaliser",
    "CellShard",
    "cell_shard",
    "CellShardDataset",
    "gather_cells",
    "read_sample_sharded",
    "PROGNOSTIC",
    "FORCING",
    "DIAGNOSTIC",
    "VARIABLES",
    "SyntheticDynamics",
    "unit_vectors",
    "rotation_matrix",
    "insolation",
    "generate_synthetic_dataset",
]
