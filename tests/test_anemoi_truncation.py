"""anemoi checkpoints with a truncated residual (``TruncatedConnection``, an AIFS 1.x model's ``A_down`` /
``A_up``) import as ``model.residual: "truncated"`` with anemoi's own two matrices as the graph's truncation
edges (:mod:`stormshard.checkpoint.anemoi_truncation`). No anemoi needed.

The fixture ``fixtures/anemoi/gt_truncated`` (anemoi-training 0.17.1 / anemoi-models 0.19.0,
``make_fixtures.py``): ``TruncatedConnection`` built on the fly (O16 data, O4 truncation grid, 3 neighbours,
sigma 0.15). The other forms are derived from it by rewriting its pickled object tree
(:mod:`tests.anemoi_repickle`): the matrices as edges of the Lightning file's graph, and the AIFS 1.x layout
(anemoi-models 0.10: ``A_down`` / ``A_up`` sparse COO attributes of the model and the scipy matrices they were
made from, metadata 1.0 with ``hardware.files.truncation``). Import, fan-out at gpus_per_model 2 and the
export round trip of the fixture are in ``test_anemoi_import.py`` (variant ``gt_truncated``).
"""

from __future__ import annotations

import json
import zipfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

import stormshard
from launch.convert_checkpoint import main as convert_main
from stormshard.checkpoint.anemoi_import import import_anemoi, read_anemoi
from stormshard.checkpoint.anemoi_pickle import SparseTensor, open_anemoi_checkpoint
from stormshard.checkpoint.anemoi_truncation import sparse_entries
from stormshard.checkpoint.errors import ConversionError
from stormshard.graphs.builder import TRUNCATION_DOWN, TRUNCATION_UP, TruncationGrid, add_truncation
from stormshard.graphs.grids import grid_from_name
from stormshard.graphs.hetero import HeteroGraph
from stormshard.graphs.sphere import latlon_to_xyz
from tests.anemoi_repickle import module_children, new_stub, rewrite_metadata, save_stub_tree
from tests.test_anemoi_export import _anemoi, needs_anemoi
from tests.test_anemoi_layouts import _old_metadata

FIXTURES = Path(__file__).parent / "fixtures" / "anemoi"
VARIANT = FIXTURES / "gt_truncated"
INFERENCE, LAST = VARIANT / "inference.ckpt", VARIANT / "last.ckpt"


def _errors(capsys) -> tuple[list[str], str]:  # noqa: ANN001
    err = capsys.readouterr().err
    return [line for line in err.splitlines() if line.startswith("error:")], err


def _predict_error(model) -> np.ndarray:  # noqa: ANN001
    """Per output variable: max |predict - anemoi's predict_step| / the variable's spread (fixture inputs)."""
    x = torch.from_numpy(np.load(VARIANT / "input.npy"))
    expected = np.load(VARIANT / "output.npy")
    got = model.predict(x).numpy()
    spread = expected.reshape(-1, expected.shape[-1]).std(axis=0)
    return np.abs(got - expected).reshape(-1, expected.shape[-1]).max(axis=0) / spread


def _pickled_matrices(path: Path = INFERENCE) -> dict[str, SparseTensor]:
    """``{"down", "up"}``: the projection matrices the fixture's pickled TruncatedConnection holds."""
    model = module_children(open_anemoi_checkpoint(path).root)["model"]
    residual = module_children(module_children(module_children(model)["residual"])["data"])
    return {k: residual[f"provider_{k}"].__dict__["projection_matrix"] for k in ("down", "up")}


def _dense(rows: torch.Tensor, cols: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    return torch.zeros(shape, dtype=torch.float64).index_put_((rows.long(), cols.long()), values.double(),
                                                              accumulate=True)


def _graph_matrix(graph, edge_type, shape: tuple[int, int] | None = None) -> torch.Tensor:  # noqa: ANN001
    """The matrix ``(destinations, sources)`` of a graph's truncation edge set."""
    src, _, dst = edge_type
    ei = graph[edge_type].edge_index
    return _dense(ei[1], ei[0], graph[edge_type].edge_weight, shape or (graph[dst].num_nodes, graph[src].num_nodes))


@pytest.mark.filterwarnings("ignore:Sparse")  # torch's notes on making the reference sparse tensors
def test_sparse_tensors_are_read_as_checked_records(tmp_path):
    """A pickled sparse tensor becomes an inert record (no sparse tensor is built from unchecked parts), and
    its entries are checked before use: COO and CSR read, malformed ones are errors naming them."""
    csr = torch.sparse_csr_tensor(torch.tensor([0, 1, 3]), torch.tensor([2, 0, 1]), torch.tensor([1.0, 0.25, 0.75]),
                                  size=(2, 3))
    coo = csr.to_sparse_coo().coalesce()
    path = tmp_path / "sparse.ckpt"
    torch.save({"state_dict": {}, "csr": csr, "coo": coo}, path)
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(f"{z.namelist()[0].split('/')[0]}/anemoi-metadata/anemoi.json", '{"version": "2.0"}')
    root = open_anemoi_checkpoint(path).root
    assert isinstance(root["csr"], SparseTensor) and root["csr"].layout == torch.sparse_csr
    assert isinstance(root["coo"], SparseTensor) and root["coo"].coalesced is True
    for name in ("csr", "coo"):
        p = sparse_entries(root[name], name)
        assert p.shape == (2, 3) and torch.equal(_dense(p.rows, p.cols, p.values, p.shape), csr.to_dense().double())
    bad = SparseTensor(torch.sparse_csr, (torch.tensor([0, 1, 3]), torch.tensor([2, 0, 5]), torch.ones(3)), (2, 3))
    with pytest.raises(ConversionError, match=r"(?s)m: malformed sparse matrix .*column indices in \[0, 5\]"):
        sparse_entries(bad, "m")
    bad = SparseTensor(torch.sparse_csr, (torch.tensor([0, 2, 1]), torch.tensor([2, 0, 1]), torch.ones(3)), (2, 3))
    with pytest.raises(ConversionError, match="row pointers not from 0 to 3 in order"):
        sparse_entries(bad, "m")
    with pytest.raises(ConversionError, match="not a sparse tensor"):
        sparse_entries(torch.ones(2, 3), "m")


def test_the_residual_is_anemois_two_matrices(tmp_path):
    """The imported graph's truncation edges are exactly the pickled CSR matrices (fp32), the truncation nodes
    are the O4 grid (checked against the matrices), and the residual matters: the same weights with the last
    input step as residual are far from anemoi's output."""
    bundle = import_anemoi(INFERENCE, tmp_path / "bundle")
    imported = read_anemoi(INFERENCE)
    graph = imported.graph
    for key, edge_type in (("down", TRUNCATION_DOWN), ("up", TRUNCATION_UP)):
        p = sparse_entries(_pickled_matrices()[key], key)
        assert torch.equal(_graph_matrix(graph, edge_type), _dense(p.rows, p.cols, p.values, p.shape))
        assert graph[edge_type].edge_weight.dtype == torch.float32
    assert (graph["truncation"].num_nodes, graph["data"].num_nodes) == (208, 1600)
    lat, lon = grid_from_name("o4")
    assert torch.equal(graph["truncation"].x, torch.from_numpy(np.radians(np.stack([lat, lon], 1))).float())
    info = json.loads((bundle / "metadata.json").read_text())["anemoi"]["truncation"]
    assert info["nodes"] == 208 and "residual.data.provider_down / provider_up" in info["matrices"]
    assert info["coordinates"].startswith("grid 'o4'")
    assert (_predict_error(stormshard.load_model(bundle)) <= 1e-4).all()
    meta = json.loads((bundle / "metadata.json").read_text())  # the same weights, anemoi's SkipConnection instead
    meta["model"]["residual"] = "last_step"
    (bundle / "metadata.json").write_text(json.dumps(meta))
    assert _predict_error(stormshard.load_model(bundle)).max() > 1e-2


def _truncation_config(meta: dict) -> dict:
    return meta["config"]["model"]["residual"]["datasets"]["data"]


def test_coordinates_that_do_not_fit_the_matrices_are_left_out(tmp_path):
    """A truncation_config whose sigma is not the one the matrices were made with: the O4 coordinates are
    not kept (the store holds the node count, which is all the model uses), and the forecast is unchanged."""
    def other_sigma(meta: dict) -> None:
        _truncation_config(meta)["truncation_config"]["sigma"] = 0.5

    src = rewrite_metadata(INFERENCE, tmp_path / "sigma.ckpt", other_sigma)
    bundle = import_anemoi(src, tmp_path / "bundle")
    from stormshard.graphs.builder import load_graph

    graph = load_graph(bundle / "graph.pt")
    assert "x" not in graph["truncation"] and graph["truncation"].num_nodes == 208
    info = json.loads((bundle / "metadata.json").read_text())["anemoi"]["truncation"]
    assert info["coordinates"].startswith("none: the matrices are not the 3-nearest-neighbour Gaussian weights")
    assert (_predict_error(stormshard.load_model(bundle)) <= 1e-4).all()


def test_the_on_the_fly_matrices_are_not_rebuilt_exactly():
    """Why a Lightning file of the on-the-fly form is refused rather than rebuilt: stormshard's k nearest
    neighbours on the same coordinates (O16 -> O4, k = 3, sigma 0.15) choose other nodes than anemoi's in the
    rows where two candidates are equidistant, though every weight they agree on is anemoi's to fp32."""
    x = open_anemoi_checkpoint(INFERENCE).root.__dict__["graph_data"].__dict__["_node_store_dict"]["data"]
    x = x.__dict__["_mapping"]["x"].double().numpy()
    graph = HeteroGraph()
    add_truncation(graph, TruncationGrid(grid="o4", num_neighbours=3, sigma=0.15), latlon_to_xyz(x[:, 0], x[:, 1]))
    differ = {}
    for key, edge_type in (("down", TRUNCATION_DOWN), ("up", TRUNCATION_UP)):
        p = sparse_entries(_pickled_matrices()[key], key)
        anemoi, ours = _dense(p.rows, p.cols, p.values, p.shape), _graph_matrix(graph, edge_type, p.shape)
        rows = ((anemoi != 0) != (ours != 0)).any(dim=1)
        differ[key] = int(rows.sum())
        assert float((anemoi - ours)[~rows].abs().max()) < 1e-6
    assert differ == {"down": 2, "up": 62}


@pytest.mark.parametrize("form", ["on the fly", "files"])
def test_a_lightning_checkpoint_without_the_matrices_is_a_clear_error(form, tmp_path, capsys):
    """``last.ckpt`` of the on-the-fly form (the fixture's own) and of the file form: exit 2, one error line
    naming the file and why, the fix (the inference checkpoint) after it, nothing written."""
    src = LAST
    if form == "files":
        def files(meta: dict) -> None:
            _truncation_config(meta)["truncation_config"] = {"truncation_down_file_path": "/data/o16_to_o4.npz",
                                                             "truncation_up_file_path": "/data/o4_to_o16.npz"}
        src = rewrite_metadata(LAST, tmp_path / "files.ckpt", files)
    out = tmp_path / "bundle"
    assert convert_main(["import-anemoi", str(src), "--out", str(out)]) == 2
    errors, err = _errors(capsys)
    assert len(errors) == 1 and errors[0].startswith(f"error: {src}: a Lightning checkpoint of a model with a "
                                                     "truncated residual holds no truncation matrices"), errors
    assert ("not unique on octahedral grids" if form == "on the fly" else "'/data/o16_to_o4.npz'") in errors[0]
    assert "import the inference-*.ckpt anemoi-training wrote with this file" in err and "Traceback" not in err
    assert not out.exists()


def _graph_store(template, key, mapping: dict):  # noqa: ANN001, ANN202 - a stubbed torch-geometric store
    store = type(template).__new__(type(template))
    store.__dict__.update(_mapping=mapping, _parent=template.__dict__["_parent"], _key=key)
    return store


def test_a_lightning_checkpoint_of_truncation_edges_in_its_graph_imports(tmp_path):
    """The edge form (the residual names a ``data -> truncation`` / ``truncation -> data`` edge set of the
    model's graph, weights ``gauss_weight``, ``row_normalize``): ``last.ckpt`` holds that graph, so the
    matrices are anemoi's ``ProjectionGraphProvider`` arithmetic on its edges (here weights doubled, the row
    normalisation undoing it). Derived from the fixture's last.ckpt: its graph gets the inference
    checkpoint's matrices as edges; the import equals the inference checkpoint's and predicts anemoi's output."""
    ckpt = open_anemoi_checkpoint(LAST)
    graph = ckpt.root["hyper_parameters"]["graph_data"].__dict__
    nodes, edges = graph["_node_store_dict"], graph["_edge_store_dict"]
    lat, lon = grid_from_name("o4")
    x = torch.from_numpy(np.radians(np.stack([lat, lon], 1))).float()
    nodes["o4"] = _graph_store(nodes["hidden"], "o4", {"x": x, "node_type": "ReducedGaussianGridNodes"})
    for key, edge_type in (("down", ("data", "to", "o4")), ("up", ("o4", "to", "data"))):
        p = sparse_entries(_pickled_matrices()[key], key)
        edges[edge_type] = _graph_store(edges[("data", "to", "hidden")], edge_type, {
            "edge_index": torch.stack([p.cols, p.rows]), "edge_type": "KNNEdges", "gauss_weight": 2 * p.values[:, None]})

    def edge_form(meta: dict) -> None:
        _truncation_config(meta).update(truncation_config=None, truncation_down_edges_name=["data", "to", "o4"],
                                        truncation_up_edges_name=["o4", "to", "data"], row_normalize=True,
                                        edge_weight_attribute="gauss_weight")

    src = save_stub_tree(ckpt.root, tmp_path / "last-edges.ckpt", LAST, edit_metadata=edge_form)
    ours, ref = read_anemoi(src), read_anemoi(INFERENCE)
    assert ours.config == ref.config and ours.config.residual == "truncated"
    assert all(torch.equal(ours.weights[n], ref.weights[n]) for n in ref.weights)
    for edge_type in (TRUNCATION_DOWN, TRUNCATION_UP):
        torch.testing.assert_close(_graph_matrix(ours.graph, edge_type), _graph_matrix(ref.graph, edge_type),
                                   rtol=0, atol=1e-7)
    assert torch.equal(ours.graph["truncation"].x, x)
    info = ours.metadata["anemoi"]["truncation"]
    assert "('data', 'to', 'o4') / ('o4', 'to', 'data') edges" in info["matrices"]
    assert info["coordinates"] == "the stored graph's 'o4' nodes"
    bundle = import_anemoi(src, tmp_path / "bundle")
    assert (_predict_error(stormshard.load_model(bundle)) <= 1e-4).all()


def _coo(matrix: SparseTensor) -> SparseTensor:
    """anemoi-models 0.10's ``_make_truncation_matrix``: a coalesced fp32 sparse COO tensor."""
    p = sparse_entries(matrix, "m")
    return SparseTensor(torch.sparse_coo, (torch.stack([p.rows, p.cols]), p.values.clone()), p.shape, True)


def _scipy_csr(matrix: SparseTensor):  # noqa: ANN202 - what anemoi-training's load_npz gave the model
    crow, col, values = matrix.parts
    return new_stub("scipy.sparse._csr.csr_matrix", _shape=tuple(matrix.size), maxprint=50,
                    indptr=crow.numpy().astype(np.int32), indices=col.numpy().astype(np.int32), data=values.numpy())


def _module(modules: dict) -> object:
    return new_stub("torch.nn.modules.container.ModuleList", training=False, _parameters=OrderedDict(),
                    _buffers=OrderedDict(), _non_persistent_buffers_set=set(), _modules=OrderedDict(modules))


def _aifs1(path: Path, matrices: bool = True) -> Path:
    """The fixture's inference checkpoint in anemoi-models 0.10's layout (AIFS 1.x): one unnamed encoder and
    decoder with their edges and trainable edge tensors inside, a chunked processor, ``node_dst_mlp.N``,
    per-model pre/post-processors, no residual module but the model's ``A_down`` / ``A_up`` (and the scipy
    matrices of ``hardware.files.truncation`` / ``truncation_inv`` they were made from, ``_truncation_data``);
    metadata 1.0 in ``ai-models.json``. ``matrices=False``: the model holds none (a model saved without them)."""
    root = open_anemoi_checkpoint(INFERENCE).root
    model = module_children(root)["model"]
    mods = module_children(model)
    for mapper in ("encoder", "decoder", "processor"):
        provider = mods.pop(f"{mapper}_graph_provider")
        if mapper != "processor":
            mods[mapper] = module_children(mods[mapper])["0"]
            provider = module_children(provider)["data"]
        module_children(mods[mapper])["trainable"] = module_children(provider)["trainable"]
        buffers = provider.__dict__["_buffers"]
        mods[mapper].__dict__["_buffers"].update({k: buffers[k] for k in ("edge_attr", "edge_index_base", "edge_inc")})
    proc = module_children(mods["processor"])
    proc["proc"] = _module({"0": _module({"blocks": proc["proc"]})})
    stack = [model]
    while stack:  # 0.16's glu_mlp_implementation undone: node_dst_mlp.mlp.N -> node_dst_mlp.N
        children = module_children(stack.pop())
        for name in ("node_dst_mlp", "node_src_mlp"):
            inner = module_children(children[name]) if name in children else {}
            if "mlp" in inner:
                children[name] = inner["mlp"]
        stack += [c for c in children.values() if c is not None]
    for part in ("pre_processors", "post_processors"):
        module_children(root)[part] = module_children(module_children(root)[part])["data"]
    mods["boundings"] = module_children(mods["boundings"])["data"]
    pickled = _pickled_matrices()
    del mods["residual"]
    if matrices:
        model.__dict__.update(A_down=_coo(pickled["down"]), A_up=_coo(pickled["up"]),
                              _truncation_data={"down": _scipy_csr(pickled["down"]), "up": _scipy_csr(pickled["up"])})
    else:
        model.__dict__.update(A_down=None, A_up=None, _truncation_data={})

    def aifs1(meta: dict) -> None:
        old = _old_metadata(meta, "0.10")
        meta.clear()
        meta.update(old)
        meta["config"]["hardware"] = {"files": {"truncation": "O16-to-O4.npz", "truncation_inv": "O4-to-O16.npz"}}

    return save_stub_tree(root, path, INFERENCE, edit_metadata=aifs1, metadata_name="ai-models.json")


def test_an_aifs1_model_holding_its_truncation_matrices_imports(tmp_path, capsys):
    """The AIFS 1.x layout (anemoi-models 0.10) of the fixture: the layout's renames apply (listed in the
    bundle), ``A_down`` / ``A_up`` become the truncation edges (anemoi kept no truncation coordinates: the
    store holds the node count), and the import predicts what anemoi's predict_step predicts."""
    src = _aifs1(tmp_path / "aifs1.ckpt")
    ckpt = open_anemoi_checkpoint(src)
    assert "scipy.sparse._csr.csr_matrix" in ckpt.stubbed and ckpt.metadata["version"] == "1.0"
    out = tmp_path / "bundle"
    assert convert_main(["import-anemoi", str(src), "--out", str(out)]) == 0
    meta = json.loads((out / "metadata.json").read_text())
    migrations = " ".join(meta["anemoi"]["migrations"])
    assert all(m in migrations for m in ("0.11.0 chunking_fix", "0.11.3 refactor_mapper",
                                         "0.12.0 move_to_multiple_datasets", "0.16.0 glu_mlp")), migrations
    assert meta["anemoi"]["architecture_from"] == "metadata config" and meta["model"]["residual"] == "truncated"
    info = meta["anemoi"]["truncation"]
    assert info["matrices"] == "the pickled model's A_down / A_up" and info["coordinates"].startswith("none: an AIFS 1.x")
    ref = read_anemoi(INFERENCE)
    ours = read_anemoi(src)
    assert all(torch.equal(ours.weights[n], ref.weights[n]) for n in ref.weights)
    for edge_type in (TRUNCATION_DOWN, TRUNCATION_UP):
        assert torch.equal(_graph_matrix(ours.graph, edge_type), _graph_matrix(ref.graph, edge_type))
    assert (_predict_error(stormshard.load_model(out)) <= 1e-4).all()
    without = _aifs1(tmp_path / "aifs1-without.ckpt", matrices=False)
    assert convert_main(["import-anemoi", str(without), "--out", str(tmp_path / "b")]) == 2
    errors, _ = _errors(capsys)
    assert len(errors) == 1 and errors[0] == (
        f"error: {without}: the model's residual is truncation matrices (hardware.files.truncation), and its pickled "
        "model holds no truncation matrices (no TruncatedConnection providers, no A_down / A_up)"), errors
    assert not (tmp_path / "b").exists()


@pytest.mark.parametrize("change", ["residual", "edges"])
def test_export_into_the_anemoi_checkpoint_keeps_its_residual(change, tmp_path, capsys):
    """export-anemoi writes an imported bundle's weights into the anemoi checkpoint it came from, whose pickled
    residual is copied unchanged: a bundle whose residual is not that one any more (``model.residual`` set to
    the last step, or other truncation weights in its graph) is refused (exit 2, one error line), not written."""
    from stormshard.graphs.builder import load_graph, save_graph

    bundle = import_anemoi(INFERENCE, tmp_path / "bundle")
    if change == "residual":
        meta = json.loads((bundle / "metadata.json").read_text())
        meta["model"]["residual"] = "last_step"
        (bundle / "metadata.json").write_text(json.dumps(meta))
    else:
        graph = load_graph(bundle / "graph.pt")
        graph[TRUNCATION_UP].edge_weight = graph[TRUNCATION_UP].edge_weight * 1.01
        save_graph(graph, bundle / "graph.pt")
    out = tmp_path / "out.ckpt"
    assert convert_main(["export-anemoi", str(bundle), "--out", str(out)]) == 2
    errors, _ = _errors(capsys)
    expected = ("model.residual='last_step', and the anemoi checkpoint it descends from adds a truncated residual"
                if change == "residual" else "the graph's truncation -> data truncation edges are not the matrix")
    assert len(errors) == 1 and errors[0].startswith(f"error: {bundle} (written into ") and expected in errors[0], errors
    assert not out.exists()


class _LoadNpz:
    def __reduce__(self) -> tuple:
        import scipy.sparse

        return (scipy.sparse.load_npz, ("/etc/matrix.npz",))


def test_scipy_sparse_stays_inert(tmp_path):
    """scipy.sparse may be named (an AIFS 1.x model's ``_truncation_data``: matrices rebuilt with NEWOBJ and
    their state), but a pickle calling one of its functions (``load_npz`` reads a file) is refused."""
    from stormshard.checkpoint.anemoi_pickle import UnsafeAnemoiCheckpoint

    path = tmp_path / "npz.ckpt"
    torch.save({"state_dict": {}, "payload": _LoadNpz()}, path)
    with zipfile.ZipFile(path, "a") as z:
        z.writestr(f"{z.namelist()[0].split('/')[0]}/anemoi-metadata/anemoi.json", '{"version": "2.0"}')
    with pytest.raises(UnsafeAnemoiCheckpoint, match=r"scipy\.sparse\..*load_npz called with arguments"):
        open_anemoi_checkpoint(path)


@needs_anemoi
def test_an_aifs1_import_exports_by_building_and_predicts_as_the_original(tmp_path):
    """A bundle imported from the AIFS 1.x layout (truncation nodes without coordinates: their count only)
    exports by building anemoi's model (a TruncatedConnection on the count-only truncation node set), and
    anemoi's predict_step of the result equals that of the original anemoi model."""
    bundle = import_anemoi(_aifs1(tmp_path / "aifs1.ckpt"), tmp_path / "bundle")
    out = tmp_path / "back.ckpt"
    run = _anemoi("launch/convert_checkpoint.py", "export-anemoi", str(bundle), "--out", str(out))
    assert run.returncode == 0, run.stderr[-3000:]
    run = _anemoi(str(FIXTURES / "anemoi_predict.py"), str(out), str(VARIANT / "input.npy"), str(tmp_path / "y.npy"),
                  str(tmp_path / "meta.json"))
    assert run.returncode == 0, run.stderr[-3000:]
    expected, got = np.load(VARIANT / "output.npy"), np.load(tmp_path / "y.npy")
    spread = expected.reshape(-1, expected.shape[-1]).std(axis=0)
    assert (np.abs(got - expected).reshape(-1, expected.shape[-1]).max(axis=0) / spread <= 1e-4).all()
