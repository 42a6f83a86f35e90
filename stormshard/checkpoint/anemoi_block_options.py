"""anemoi-models' ``qk_norm`` and ``mlp_implementation`` of the transformer and graph-transformer blocks, read from an
anemoi checkpoint (the import) and written into an anemoi config (the export), per section (``processor``,
``encoder``, ``decoder``).

Read:

- ``qk_norm``: from the tensors (``q_norm.weight`` / ``k_norm.weight`` of the section's first block); the norm must
  be anemoi's default ``QueryNorm`` / ``KeyNorm`` (``AutocastLayerNorm`` or torch's ``LayerNorm``, ``bias: False``,
  eps 1e-5): the pickled module's class and eps, or for Lightning files the config's ``layer_kernels`` (the
  section's, else the model's; none: anemoi's default);
- ``mlp_implementation``: gated where the tensors hold ``gate_proj`` / ``value_proj``; which gate from the pickled
  ``GatedMLPLayer``'s activation (``Sigmoid``: ``glu``, ``SiLU``: ``swiglu``, exact ``GELU``: ``geglu``, ``ReLU``:
  ``reglu``), or from the section's ``mlp_implementation`` in the metadata's config, which must agree with the tensors;
- the MLP's hidden width (``gate_proj`` rows for a gated MLP), for ``mlp_ratio``.

What stormshard's blocks cannot hold (another norm class, a norm bias, another eps, an approximate GELU gate) is a
problem naming the section; nothing is written.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from stormshard.checkpoint.anemoi_layouts import model_config_json
from stormshard.checkpoint.anemoi_pickle import AnemoiCheckpoint, stub_class_name
from stormshard.models.config import ModelConfig

__all__ = ["SECTIONS", "block_prefixes", "mlp_hidden", "block_options", "anemoi_block_options"]

#: the sections with anemoi attention blocks
SECTIONS = ("processor", "encoder", "decoder")
_GATES = {"Sigmoid": "glu", "SiLU": "swiglu", "GELU": "geglu", "ReLU": "reglu"}
_NORMS = ("AutocastLayerNorm", "LayerNorm")


def block_prefixes(kind: str, section: str) -> tuple[str, str]:
    """(attention prefix holding ``q_norm`` / ``k_norm``, block MLP prefix) of the section's first block, canonical
    names; ``kind``: ``transformer`` or ``graphtransformer``."""
    if section != "processor":
        block = f"model.{section}.0.proc"
        return block, f"{block}.node_dst_mlp"
    if kind == "transformer":
        return "model.processor.proc.0.attention", "model.processor.proc.0.mlp"
    return "model.processor.proc.0", "model.processor.proc.0.node_dst_mlp"


def mlp_hidden(t: dict[str, Tensor], prefix: str) -> int:
    """The hidden width of anemoi's block MLP at ``prefix`` (a gated MLP's gate width); KeyError if absent."""
    gate = t.get(f"{prefix}.mlp.0.gate_proj.weight")
    return int((gate if gate is not None else t[f"{prefix}.mlp.0.weight"]).shape[0])


def _child(obj: Any, name: str | None) -> Any:
    """A pickled module's child (``name`` None: its first), or None."""
    if obj is None:
        return None
    d = obj.__dict__ if hasattr(obj, "__dict__") else {}
    modules = d.get("_modules") or {}
    if name is None:
        return next(iter(modules.values()), None)
    return modules.get(name, d.get(name))


def _pickled_block(ckpt: AnemoiCheckpoint, kind: str, section: str) -> tuple[Any, Any] | None:
    """(the pickled attention module holding the norms, the block MLP's first layer), or None (no pickled model)."""
    if ckpt.kind != "inference":
        return None
    model = _child(ckpt.root, "model")
    if section == "processor":
        block = _child(_child(_child(model, "processor"), "proc"), None)
        attention = _child(block, "attention") if kind == "transformer" else block
        mlp = _child(block, "mlp" if kind == "transformer" else "node_dst_mlp")
    else:
        attention = _child(_child(_child(model, section), None), "proc")
        mlp = _child(attention, "node_dst_mlp")
    first = _child(_child(mlp, "mlp"), "0")
    return (attention, first) if attention is not None and first is not None else None


def _section_config(ckpt: AnemoiCheckpoint, section: str) -> dict[str, Any]:
    model = model_config_json(ckpt.metadata)
    if section == "processor":
        found = model.get("processor")
    else:
        many = model.get(f"{section}s")
        found = next(iter(many.values()), {}).get("mapper") if isinstance(many, dict) and many else model.get(section)
    return found if isinstance(found, dict) else {}


def _norm_problem(ckpt: AnemoiCheckpoint, pickled: Any, section: str, which: str) -> str | None:
    """Why the section's ``QueryNorm`` / ``KeyNorm`` is not anemoi's default (None: it is)."""
    attr = {"QueryNorm": "q_norm", "KeyNorm": "k_norm"}[which]
    if pickled is not None:
        norm = _child(pickled, attr)
        cls = (stub_class_name(norm) or "?").rsplit(".", 1)[-1]
        eps = (norm.__dict__ if hasattr(norm, "__dict__") else {}).get("eps", 1e-5)
    else:
        kernels = _section_config(ckpt, section).get("layer_kernels") or \
            model_config_json(ckpt.metadata).get("layer_kernels") or {}
        entry = kernels.get(which) if isinstance(kernels, dict) else None
        entry = entry if isinstance(entry, dict) else {}
        cls = str(entry.get("_target_", "AutocastLayerNorm")).rsplit(".", 1)[-1]
        eps = entry.get("eps", 1e-5)
    if cls not in _NORMS or float(eps) != 1e-5:
        return (f"{section} qk_norm with {which} {cls} (eps {eps}): stormshard's query / key norm is anemoi's default "
                "AutocastLayerNorm (bias False, eps 1e-5)")
    return None


def _gate_kind(ckpt: AnemoiCheckpoint, pickled: Any, section: str) -> tuple[str | None, str | None]:
    """(the gated kind, a problem) of a section whose tensors hold a gated MLP."""
    if pickled is not None:
        gate = _child(pickled, "gating")
        cls = (stub_class_name(gate) or "?").rsplit(".", 1)[-1]
        kind = _GATES.get(cls)
        approximate = (gate.__dict__ if hasattr(gate, "__dict__") else {}).get("approximate", "none")
        if kind is None or cls == "GELU" and approximate != "none":
            return None, f"{section} gated MLP with the gate activation {cls} (approximate {approximate!r})"
        return kind, None
    kind = str(_section_config(ckpt, section).get("mlp_implementation", "mlp"))
    if kind not in _GATES.values():
        return None, (f"{section} MLP with gate_proj / value_proj tensors but mlp_implementation={kind!r} in the "
                      "checkpoint's config")
    return kind, None


def block_options(ckpt: AnemoiCheckpoint, t: dict[str, Tensor], kind: str,
                  problems: list[str]) -> dict[str, dict[str, Any]]:
    """``{section: {"qk_norm": ..., "mlp_implementation": ...}}`` of a ``transformer`` or ``graphtransformer``
    model (module docstring); what stormshard cannot hold is appended to ``problems``."""
    out = {}
    for section in SECTIONS:
        attention, mlp = block_prefixes(kind, section)
        pickled = _pickled_block(ckpt, kind, section)
        options: dict[str, Any] = {"qk_norm": f"{attention}.q_norm.weight" in t, "mlp_implementation": "mlp"}
        if options["qk_norm"]:
            if f"{attention}.q_norm.bias" in t or f"{attention}.k_norm.bias" in t:
                problems.append(f"{section} qk_norm with a norm bias (stormshard's query / key norms have none, as "
                                "anemoi's default)")
            problems += [p for which in ("QueryNorm", "KeyNorm")
                         if (p := _norm_problem(ckpt, None if pickled is None else pickled[0], section, which))]
        if f"{mlp}.mlp.0.gate_proj.weight" in t:
            gate, problem = _gate_kind(ckpt, None if pickled is None else pickled[1], section)
            problems += [problem] if problem else []
            options["mlp_implementation"] = gate or "mlp"
        elif pickled is None and str(_section_config(ckpt, section).get("mlp_implementation", "mlp")) != "mlp":
            problems.append(f"{section} mlp_implementation="
                            f"{_section_config(ckpt, section).get('mlp_implementation')!r} in the config but an "
                            "ungated MLP in the tensors")
        out[section] = options
    return out


def anemoi_block_options(config: ModelConfig, section: str) -> dict[str, Any]:
    """The anemoi config keys of a section's blocks (the export): ``qk_norm`` and ``mlp_implementation``."""
    own = getattr(config, section)
    return {"qk_norm": bool(own.qk_norm), "mlp_implementation": str(own.mlp_implementation)}
