"""The house rules of ``stormshard/``, read from the source: dependencies point down the floors,
no module imports another module's private name, and no file is over 600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "stormshard"
MAX_LINES = 600

#: The floors, lowest first. A package imports only packages on lower floors (and itself):
#: parallel knows nothing of weather; kernels import nothing of the layers that call them;
#: checkpoint/ and inference/ stand below training/.
FLOORS: dict[str, int] = {
    "errors": 0, "env": 0, "lazy": 0, "progress": 0,
    "parallel": 1, "kernels": 1,
    "graphs": 2, "layers": 2,
    "data": 3, "models": 3,
    "checkpoint": 4,
    "inference": 5,
    "training": 6,
    "cli": 7,
}


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _package(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0].removesuffix(".py")


def _imports(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every ``stormshard`` import in ``path``, in functions too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "stormshard":
            out.append((node.lineno, node.module, [a.name for a in node.names]))
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name, []) for a in node.names if a.name.split(".")[0] == "stormshard"]
    return out


def test_every_package_has_a_floor():
    packages = {_package(p) for p in _sources()} - {"__init__", "__main__"}
    assert packages <= set(FLOORS), f"packages without a floor in FLOORS: {sorted(packages - set(FLOORS))}"


def test_dependencies_point_down():
    wrong = []
    for path in _sources():
        here = _package(path)
        if here not in FLOORS:
            continue
        for line, module, _ in _imports(path):
            parts = module.split(".")
            there = parts[1] if len(parts) > 1 else "__init__"
            if there == here:
                continue
            if there not in FLOORS or FLOORS[there] >= FLOORS[here]:
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} ({here}) imports {module}")
    assert not wrong, "imports that point up or sideways:\n" + "\n".join(wrong)


def test_no_private_name_imported_across_modules():
    wrong = []
    for path in _sources():
        for line, module, names in _imports(path):
            private = [n for n in names if n.startswith("_") and not n.startswith("__")]
            if private or any(p.startswith("_") and not p.startswith("__") for p in module.split(".")):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} from {module} import {', '.join(names)}")
    assert not wrong, "private names imported from other modules:\n" + "\n".join(wrong)


def test_no_file_over_600_lines():
    long = {str(p.relative_to(PACKAGE.parent)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them by job): {long}"
