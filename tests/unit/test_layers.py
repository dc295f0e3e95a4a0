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


@pytest.mark.parametrize("layer, rel, tree", [m for m in modules() if m[0] != "swarm"],
                         ids=lambda v: str(v) if isinstance(v, Path) else "")
def test_only_the_swarm_layer_imports_hivemind(layer, rel, tree):
    """The hivemind driver is the only hivemind user: the simulator, the faults and the wiring reach it through
    swarm/ (test-only faults included: a subclass of our averager overrides our methods, not hivemind's)."""
    assert not any(name.split(".")[0] == "hivemind" for name in imported(tree)), f"{rel} imports hivemind"


@pytest.mark.parametrize("layer, rel, tree", [m for m in modules() if m[0] in FORBIDDEN],
                         ids=lambda v: str(v) if isinstance(v, Path) else "")
def test_the_protocol_and_the_math_use_neither_hivemind_nor_the_clock(layer, rel, tree):
    roots = {name.split(".")[0] for name in imported(tree)}
    assert not roots & FORBIDDEN[layer], f"{rel} imports {sorted(roots & FORBIDDEN[layer])}"


def constructors():
    for layer, rel, tree in modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                        yield f"{rel}:{node.name}", item


STARTS = {"start", "run_in_background", "Popen", "fork", "start_lifeline", "start_dht", "start_averager"}


def test_no_constructor_starts_a_process_or_a_thread():
    """Objects are built whole, then started by whoever wires them (p2pdiloco.parts.startup): a constructor that
    forks cannot be built from fakes in a test, and forks at a moment its caller does not choose."""
    starting = []
    for where, init in constructors():
        for node in ast.walk(init):
            called = node.func if isinstance(node, ast.Call) else None
            name = getattr(called, "attr", None) or getattr(called, "id", None)
            start_kw = isinstance(node, ast.Call) and any(k.arg == "start" and getattr(k.value, "value", None) is True
                                                          for k in node.keywords)
            if name in STARTS or start_kw:
                starting.append(f"{where} line {node.lineno}: {name}")
    assert not starting, starting


def test_no_constructor_is_longer_than_20_lines():
    long = [f"{where}: {init.end_lineno - init.lineno + 1} lines" for where, init in constructors()
            if init.end_lineno - init.lineno + 1 > 20]
    assert not long, long


def test_no_production_module_names_a_fault():
    """Test-only faults come from outside (p2pdiloco.faults: subclasses the fault plan picks), never as a branch of
    a production class."""
    from p2pdiloco.faults.plan import ACTIONS

    naming = [f"{path.relative_to(PACKAGE)}: {action}" for path in sorted(PACKAGE.rglob("*.py"))
              if path.relative_to(PACKAGE).parts[0] != "faults"
              for action in ACTIONS if action in path.read_text()]
    assert not naming, naming


def test_the_peer_is_wiring_a_short_module_whose_parts_are_built_whole():
    """peer.py at most 300 lines; every object the startup wires holds at most 15 attributes, all set in its
    constructor (none first set in a later method)."""
    assert len((PACKAGE / "peer.py").read_text().splitlines()) <= 300
    for rel in ("peer.py", "parts/stay.py", "parts/membership.py", "parts/checkpoints.py", "swarm/rounds.py"):
        tree = ast.parse((PACKAGE / rel).read_text())
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            set_in = {}
            for method in (m for m in cls.body if isinstance(m, ast.FunctionDef)):
                for node in ast.walk(method):
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
                        if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
                    for target in (e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])):
                        if isinstance(target, ast.Attribute) and getattr(target.value, "id", None) == "self":
                            set_in.setdefault(target.attr, set()).add(method.name)
            late = sorted(a for a, methods in set_in.items() if "__init__" not in methods)
            assert not late, f"{rel}:{cls.name} first sets {late} outside __init__"
            assert len(set_in) <= 15, f"{rel}:{cls.name} has {len(set_in)} attributes: {sorted(set_in)}"
