"""Architectural rules, checked on the source: imports point one way, and the round protocol and the DiLoCo math
touch neither hivemind nor the clock (the simulator drives the protocol on a clock of its own)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "p2pdiloco"
# lower layers first; a module may import its own layer and those listed before it
LAYERS = [("config", "runtime"), ("core",), ("protocol",), ("training",), ("swarm", "sim"), ("faults",), ("parts",),
          ("peer",), ("ops",), ("cli", "__main__")]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}
NO_CLOCK = {"hivemind", "time", "datetime", "asyncio", "socket", "subprocess", "multiprocessing"}
# the protocol is a pure state machine; the math may hold a lock (the global state is read by the averager)
FORBIDDEN = {"core": NO_CLOCK, "protocol": NO_CLOCK | {"threading", "concurrent"}}


def modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        layer = rel.parts[0].removesuffix(".py")
        if layer != "__init__":
            yield layer, rel, ast.parse(path.read_text())


def imported(tree) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            if node.module == "p2pdiloco":
                names.update(f"p2pdiloco.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("layer, rel, tree", list(modules()), ids=lambda v: str(v) if isinstance(v, Path) else "")
def test_imports_point_down_the_layers(layer, rel, tree):
    assert layer in RANK, f"{rel}: put it in a layer of tests/unit/test_layers.py"
    for name in imported(tree):
        if name.startswith("p2pdiloco."):
            target = name.split(".")[1]
            assert target in RANK, f"{rel} imports {name}, which is in no layer"
            same_rank_other = RANK[target] == RANK[layer] and target != layer and layer not in ("config", "runtime")
            assert RANK[target] <= RANK[layer] and not same_rank_other, f"{rel} imports {name}: upwards or sideways"


@pytest.mark.parametrize("layer, rel, tree", [m for m in modules() if m[0] in FORBIDDEN],
                         ids=lambda v: str(v) if isinstance(v, Path) else "")
def test_the_protocol_and_the_math_use_neither_hivemind_nor_the_clock(layer, rel, tree):
    roots = {name.split(".")[0] for name in imported(tree)}
    assert not roots & FORBIDDEN[layer], f"{rel} imports {sorted(roots & FORBIDDEN[layer])}"
