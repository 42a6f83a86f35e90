"""Fine-tuning an imported anemoi model: the bundle's ``finetune_config.json`` trains through
``launch/train.py``'s config path from the bundle's weights, graph and statistics
(``training.init_weights``, ``data.graph_file``, ``data.statistics``), the same at gpus_per_model
1 and 2; transfer learning to a changed model; ``training.freeze``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import stormshard
from stormshard.checkpoint.anemoi_import import FINETUNE_DATA_PLACEHOLDER, import_anemoi
from stormshard.data.synthetic import generate_synthetic_dataset
from stormshard.training.config import ConfigError, load_experiment_config
from stormshard.training.launch import run_training
from tests.distributed import run_distributed

FIXTURES = Path(__file__).parent / "fixtures" / "anemoi"


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> tuple[Path, str]:
    root = tmp_path_factory.mktemp("finetune")
    bundle = import_anemoi(FIXTURES / "gt" / "inference.ckpt", root / "bundle")
    dataset = root / "o16.zarr"
    generate_synthetic_dataset(dataset, grid="o16", steps=24, seed=3)
    return bundle, str(dataset)


@pytest.fixture(scope="module")
def transformer_bundle(tmp_path_factory) -> Path:
    return import_anemoi(FIXTURES / "transformer" / "inference.ckpt", tmp_path_factory.mktemp("tr") / "bundle")


def _cli(bundle: Path, dataset: str, out: Path, *extra: str):
    """``launch/train.py --config BUNDLE/finetune_config.json data.path=... training.output_dir=...``."""
    items = [f"data.path={dataset}", f"training.output_dir={out}", "training.max_steps=2", "training.warmup_steps=1",
             "training.lr=1e-3", "training.micro_batch_size=1", "training.validation_interval=100",
             "training.checkpoint_interval=100", "data.train.end=2020-01-04T00", "data.validation.start=2020-01-04T06",
             "data.validation_samples=1", "data.num_workers=0", "logging.progress=false", "engine=local"]
    given = {e.partition("=")[0] for e in extra}  # a key given twice is an error: extra replaces the default
    items = [i for i in items if i.partition("=")[0] not in given] + list(extra)
    return load_experiment_config(bundle / "finetune_config.json", cli_overrides=items)


def _train(rank: int, world: int, cfg) -> tuple[list[float], dict]:
    result = run_training(cfg)
    from stormshard.checkpoint.consolidate import load_any

    return result.losses, ({k: v.clone() for k, v in load_any(result.checkpoint).model.items()} if rank == 0 else {})


def _refusal(rank: int, world: int, cfg) -> str:
    """The class name of the ConfigError ``run_training(cfg)`` raised on this rank."""
    try:
        run_training(cfg)
    except ConfigError as exc:
        return type(exc).__name__
    return "trained"


def _step0(rank: int, world: int, cfg, x: torch.Tensor) -> torch.Tensor:
    """The fine-tune run's model before its first step, on normalised input (one process)."""
    import torch.distributed as dist

    from stormshard.training.launch import init_distributed
    from stormshard.training.loop import Trainer

    if world == 1 and not dist.is_initialized():
        init_distributed()
    trainer = Trainer(cfg)
    try:
        with torch.no_grad():
            full = torch.zeros(*x.shape[:-1], len(trainer.variables.variables), dtype=torch.float64)
            full[..., trainer.variables.input_idx] = x.double()  # the diagnostic column: not an input
            xn = trainer.normaliser.normalise(full).float()[..., trainer.variables.input_idx]
            return trainer.engine.module(xn), trainer.transfer
    finally:
        trainer.close()


def test_finetune_config_trains_from_the_bundle_at_any_layout(setup, tmp_path):
    bundle, dataset = setup
    raw = json.loads((bundle / "finetune_config.json").read_text())
    assert raw["data"]["path"] == FINETUNE_DATA_PLACEHOLDER
    assert raw["data"]["graph_file"] == str(bundle.resolve() / "graph.pt")
    assert raw["training"]["init_weights"] == str(bundle.resolve())
    with pytest.raises(ConfigError, match="data.path=.* is the placeholder"):  # a clear error before any work
        run_training(load_experiment_config(bundle / "finetune_config.json",
                                            cli_overrides=[f"training.output_dir={tmp_path / 'p'}"]))
    assert not (tmp_path / "p").exists()

    one, w1 = _train(0, 1, _cli(bundle, dataset, tmp_path / "one"))
    two = run_distributed(_train, 2, _cli(bundle, dataset, tmp_path / "two", "parallel.gpus_per_model=2"))
    assert len(one) == 2 and all(np.isfinite(one))
    assert two[0][0] == two[1][0]
    np.testing.assert_allclose(two[0][0], one, rtol=2e-5, atol=0)
    for name, w in w1.items():  # the trained weights agree too (Adam amplifies fp32 sum-order noise)
        torch.testing.assert_close(two[0][1][name], w, rtol=1e-4, atol=1e-4)  # Adam: lr 1e-3 x 2 steps
    assert (tmp_path / "one" / "graph.pt").exists() is False  # the bundle's graph: nothing built


def test_finetune_transformer_tensor_parallel(setup, transformer_bundle, tmp_path):
    """The sliding-window transformer at gpus_per_model 2, shard_strategy tensor: every rank loads its
    slice of the full weights (heads and MLP channels split), and trains as one process does; the
    lin_qkv biases anemoi does not have stay frozen at zero."""
    _, dataset = setup
    bundle = transformer_bundle
    freeze = json.loads((bundle / "finetune_config.json").read_text())["training"]["freeze"]
    assert freeze and all(f.endswith("attention.lin_qkv.bias") for f in freeze)
    one, w1 = _train(0, 1, _cli(bundle, dataset, tmp_path / "one"))
    two = run_distributed(_train, 2, _cli(bundle, dataset, tmp_path / "two", "parallel.gpus_per_model=2",
                                          "parallel.shard_strategy=tensor"))
    np.testing.assert_allclose(two[0][0], one, rtol=2e-5, atol=0)
    assert all(not w1[f].any() and not two[0][1][f].any() for f in freeze)
    # the fine-tuned run -> a bundle (graph and statistics of the imported model) -> anemoi again
    from stormshard.checkpoint.anemoi_export import export_anemoi
    from stormshard.checkpoint.anemoi_import import read_anemoi
    from stormshard.checkpoint.export import export_bundle

    tuned = export_bundle(tmp_path / "one" / "checkpoints", tmp_path / "tuned")
    assert json.loads((tuned / "statistics.json").read_text()) == json.loads((bundle / "statistics.json").read_text())
    assert (tuned / "graph.pt").read_bytes() == (bundle / "graph.pt").read_bytes()
    back = read_anemoi(export_anemoi(tuned, tmp_path / "tuned.ckpt"))
    assert all(torch.equal(back.weights[n], w) for n, w in w1.items())
    assert not torch.equal(back.weights["decoder.to_q.weight"], read_anemoi(bundle / "anemoi_source.ckpt")
                           .weights["decoder.to_q.weight"])


def test_finetune_step0_predicts_what_the_bundle_predicts(setup, tmp_path):
    bundle, dataset = setup
    model = stormshard.load_model(bundle)
    x = torch.from_numpy(np.load(FIXTURES / "gt" / "input.npy"))
    theirs = model.predict(x)
    # the trainer's model (bundle weights, graph, statistics) on the bundle's normalised input
    cfg = _cli(bundle, dataset, tmp_path / "s0")
    ours, report = run_distributed(_step0, 1, cfg, x)[0]
    assert not report.fresh and not report.unused
    with torch.no_grad():
        expected = model.model(model.normaliser.normalise(x.double()).float())
    torch.testing.assert_close(ours, expected, rtol=1e-6, atol=1e-6)
    assert theirs.shape[-1] == ours.shape[-1]


@pytest.mark.parametrize("engine", [["engine=local"], ["engine=ddp"],
                                    ["engine=deepspeed", 'deepspeed={"zero_optimization": {"stage": 1}}']],
                         ids=["local", "ddp", "zero1"])
def test_transfer_learning_and_freeze(setup, tmp_path, capsys, engine):
    """num_layers + 1: every parameter but the new block's loads; frozen ones stay bit-identical and the
    checkpoint (no optimizer state for them) still consolidates."""
    bundle, dataset = setup
    layers = json.loads((bundle / "finetune_config.json").read_text())["model"]["processor"]["num_layers"]
    cfg = _cli(bundle, dataset, tmp_path / "tl", f"model.processor.num_layers={layers + 1}",
               'training.freeze=["encoder", "embed_data"]', "training.init_weights_partial=true", *engine)
    losses, trained = _train(0, 1, cfg)
    out = capsys.readouterr()
    text = out.out + out.err
    assert "parameters loaded" in text and "freshly initialised" in text
    assert f"processor.blocks.{layers}." in text
    from safetensors.torch import load_file

    start = load_file(str(bundle / "model.safetensors"))
    from stormshard.training.finetune import read_init_weights

    again = read_init_weights(tmp_path / "tl" / "checkpoints")  # a training checkpoint as init_weights
    assert all(torch.equal(again[n], w) for n, w in trained.items())
    for name, w in trained.items():
        if name.startswith(("encoder.", "embed_data.")):
            assert torch.equal(w, start[name]), name  # frozen: bit-identical
    assert not torch.equal(trained["decoder.to_q.weight"], start["decoder.to_q.weight"])
    assert f"processor.blocks.{layers}.to_q.weight" not in start


def test_init_weights_from_an_anemoi_checkpoint(setup, tmp_path):
    from safetensors.torch import load_file

    from stormshard.training.finetune import init_weights_kind, read_init_weights

    bundle, _ = setup
    ckpt = FIXTURES / "gt" / "inference.ckpt"
    assert init_weights_kind(ckpt) == "anemoi" and init_weights_kind(bundle) == "bundle"
    ours, theirs = load_file(str(bundle / "model.safetensors")), read_init_weights(ckpt)
    assert set(ours) == set(theirs) and all(torch.equal(ours[n], theirs[n]) for n in ours)
    lightning = tmp_path / "last.ckpt"  # a torch zip without anemoi metadata
    torch.save({"state_dict": {}}, lightning)
    with pytest.raises(ConfigError, match="is not a stormshard bundle"):
        init_weights_kind(lightning)


def test_finetune_bad_inputs(setup, tmp_path):
    bundle, dataset = setup
    with pytest.raises(ConfigError, match="training.init_weights=.*does not exist"):
        run_training(_cli(bundle, dataset, tmp_path / "a", f"training.init_weights={tmp_path / 'nothing'}"))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ConfigError, match="is not a stormshard bundle, an anemoi"):
        run_training(_cli(bundle, dataset, tmp_path / "b", f"training.init_weights={tmp_path / 'notes.txt'}"))
    with pytest.raises(ConfigError, match="'nowhere'"):
        run_training(_cli(bundle, dataset, tmp_path / "c", 'training.freeze=["nowhere"]'))
    assert not any((tmp_path / d).exists() for d in "abc")  # all before any work


def test_graph_dependent_init_weights_fail_with_nothing_written(setup, tmp_path):
    """Without ``data.graph_file`` the graph is built by the run. Trainable node embeddings follow the
    grids' node counts: a weights file of another grid is an error in the preflight, before any work.
    Trainable edge features follow the edge counts, known once the graph is built: that error comes
    before ``config.json``, and the graph cache the build wrote is removed; nothing stays behind."""
    bundle, dataset = setup
    other_grid = _cli(bundle, dataset, tmp_path / "a", "data.graph_file=null", "graph.hidden=ico1")
    with pytest.raises(ConfigError, match=r"hidden_embedding \(file \[162, 4\], model \[(\d+), 4\]\)"):
        run_training(other_grid)
    assert not (tmp_path / "a").exists()
    other_edges = _cli(bundle, dataset, tmp_path / "b", "data.graph_file=null", "graph.hidden=ico2")  # 1600 and 162 nodes
    with pytest.raises(ConfigError, match=r"encoder_edges.trainable"):
        run_training(other_edges)
    assert not (tmp_path / "b").exists()
    # two ranks (one model each): every rank gets the error, the others have read the cache before it goes
    two = run_distributed(_refusal, 2, _cli(bundle, dataset, tmp_path / "d", "data.graph_file=null", "graph.hidden=ico2",
                                            "engine=ddp"))
    assert two == ["GraphDependentMismatch", "GraphDependentMismatch"] and not (tmp_path / "d").exists()
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "notes.txt").write_text("mine")  # an output directory that exists keeps what it held
    with pytest.raises(ConfigError, match=r"encoder_edges.trainable"):
        run_training(_cli(bundle, dataset, tmp_path / "c", "data.graph_file=null", "graph.hidden=ico2"))
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["notes.txt"]
