"""Output boundings (anemoi's bounding kinds): each kind against a reference written the way anemoi-models writes
them (in place on a copy, its formulas), values and gradients; the order of a bounding list; the config errors.
The sharded model with boundings equals one process in tests/test_models.py (case graphtransformer-anemoi)."""

from __future__ import annotations

import pytest
import torch

from stormshard.layers.bounding import OutputBounding
from stormshard.models.config import BoundingConfig, ModelConfig
from stormshard.models.registry import build_model

NAMES = ("tp", "cp", "tcc", "q", "u")


def _anemoi_style(x: torch.Tensor, specs: list[BoundingConfig]) -> torch.Tensor:
    """anemoi-models 0.19's bounding forwards, transcribed: in-place assignments on a copy, the leaky hardtanh as
    two ``torch.where``s, each bounding's indices in the output's own order."""
    x = x.clone()
    for spec in specs:
        idx = [i for i, n in enumerate(NAMES) if n in spec.variables]
        if spec.kind.startswith("normalized"):  # anemoi reorders these to the config's order
            idx = [NAMES.index(v) for v in spec.variables]
        sel = x[..., idx]
        if spec.kind == "relu":
            x[..., idx] = torch.nn.functional.relu(sel)
        elif spec.kind == "leaky_relu":
            x[..., idx] = torch.nn.functional.leaky_relu(sel)
        elif spec.kind in ("normalized_relu", "normalized_leaky_relu"):
            t = torch.tensor(spec.thresholds, dtype=x.dtype)
            f = torch.nn.functional.relu if spec.kind == "normalized_relu" else torch.nn.functional.leaky_relu
            x[..., idx] = f(sel - t) + t
        else:
            if spec.kind.startswith("leaky"):
                lo, hi = spec.min_val, spec.max_val
                out = torch.clamp(sel, lo, hi)
                out = torch.where(sel < lo, lo + 0.01 * (sel - lo), out)
                x[..., idx] = torch.where(sel > hi, hi + 0.01 * (sel - hi), out)
            else:
                x[..., idx] = torch.nn.functional.hardtanh(sel, spec.min_val, spec.max_val)
            if spec.kind.endswith("fraction"):
                x[..., idx] *= x[..., [NAMES.index(spec.total_variable)]]
    return x


SPECS = {
    "relu": dict(kind="relu", variables=("tp", "q")),
    "leaky_relu": dict(kind="leaky_relu", variables=("q",)),
    "normalized_relu": dict(kind="normalized_relu", variables=("u", "q"), thresholds=(-0.3, 0.4)),
    "normalized_leaky_relu": dict(kind="normalized_leaky_relu", variables=("q",), thresholds=(0.1,)),
    "hardtanh": dict(kind="hardtanh", variables=("tcc",), min_val=0.0, max_val=1.0),
    "leaky_hardtanh": dict(kind="leaky_hardtanh", variables=("tcc", "u"), min_val=-0.5, max_val=0.7),
    "fraction": dict(kind="fraction", variables=("cp",), min_val=0.0, max_val=1.0, total_variable="tp"),
    "leaky_fraction": dict(kind="leaky_fraction", variables=("cp", "q"), min_val=0.0, max_val=1.0,
                           total_variable="tp"),
}


def _check(specs: list[BoundingConfig]) -> None:
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(2, 40, len(NAMES), generator=g, dtype=torch.float64) * 1.5).requires_grad_()
    ref_x = x.detach().clone().requires_grad_()
    out = OutputBounding(specs, NAMES)(x)
    ref = _anemoi_style(ref_x, specs)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-15)
    weight = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * weight).sum().backward()
    (ref * weight).sum().backward()
    torch.testing.assert_close(x.grad, ref_x.grad, rtol=0, atol=1e-15)
    assert not torch.equal(out, x.detach())  # the bounding changed something: the test can fail


@pytest.mark.parametrize("kind", list(SPECS))
def test_each_kind_equals_anemoi_formulas(kind):
    _check([BoundingConfig(**SPECS[kind])])


def test_a_list_applies_in_order_and_a_fraction_reads_the_bounded_total():
    # AIFS's pattern: precipitation made non-negative first, then convective precipitation as its fraction
    specs = [BoundingConfig(**SPECS[k]) for k in ("relu", "hardtanh", "fraction", "leaky_hardtanh")]
    _check(specs)
    x = torch.tensor([[[-2.0, 0.5, 3.0, 0.0, 0.0]]], dtype=torch.float64)
    out = OutputBounding(specs[:3], NAMES)(x)
    assert out[0, 0, NAMES.index("cp")] == 0.0  # 0.5 * relu(-2) = 0, not 0.5 * -2
    assert out[0, 0, NAMES.index("tcc")] == 1.0


def test_model_applies_boundings_after_relu_bounded():
    from tests.test_models import VARIABLES, _graph

    bounding = (BoundingConfig(kind="hardtanh", variables=("t",), min_val=-0.01, max_val=0.01),)
    config = ModelConfig(name="transformer", num_channels=16, multistep_input=2, trainable_size=2,
                         relu_bounded=("precip",), bounding=bounding,
                         processor=dict(num_layers=1, num_heads=2, window_size=5, mlp_ratio=2),
                         encoder=dict(num_heads=2), decoder=dict(num_heads=2))
    graph = _graph(False)
    model = build_model(config, graph, VARIABLES, None)
    x = torch.randn(1, 2, graph["data"].num_nodes, len(VARIABLES.input_names)) * 3
    out = model(x)
    t = out[..., VARIABLES.output_names.index("t")]
    assert t.abs().max() <= 0.01 and (t.abs() == 0.01).any()
    assert out[..., VARIABLES.output_names.index("precip")].min() >= 0


@pytest.mark.parametrize("spec, match", [
    (dict(kind="hardtanh", variables=("tcc",)), "needs min_val and max_val"),
    (dict(kind="hardtanh", variables=("tcc",), min_val=1.0, max_val=0.0), "min_val=1.0 exceeds max_val=0.0"),
    (dict(kind="relu", variables=("tp",), min_val=0.0), "takes no min_val / max_val"),
    (dict(kind="fraction", variables=("cp",), min_val=0.0, max_val=1.0), "total_variable is required"),
    (dict(kind="relu", variables=("tp",), total_variable="tp"), "total_variable is only for fraction kinds"),
    (dict(kind="normalized_relu", variables=("u", "q"), thresholds=(0.1,)), "needs thresholds: one normalised"),
    (dict(kind="hardtanh", variables=("tcc",), min_val=0.0, max_val=1.0, thresholds=(0.0,)), "takes no thresholds"),
    (dict(kind="clip", variables=("tp",)), "kind"),
    (dict(kind="relu", variables=()), "variables"),
    (dict(kind="fraction", variables=("cp", "tp"), min_val=0.0, max_val=1.0, total_variable="tp"),
     "total_variable='tp' is one of its own variables"),
])
def test_config_errors_name_the_field_and_the_fix(spec, match):
    with pytest.raises(ValueError, match=match):
        BoundingConfig(**spec)


def test_unknown_variables_are_an_error_naming_the_bounding():
    specs = [BoundingConfig(**SPECS["relu"]), BoundingConfig(kind="fraction", variables=("cp",), min_val=0.0,
                                                             max_val=1.0, total_variable="sf")]
    with pytest.raises(ValueError, match=r"model.bounding\[1\] \(kind='fraction'\) names \['sf'\], which are not "
                                         r"output variables"):
        OutputBounding(specs, NAMES)
