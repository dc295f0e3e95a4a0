"""The seams below hivemind's public API (p2pdiloco.swarm.seams): all listed, each with a test that exists."""

import ast
import inspect
import re
from pathlib import Path

import hivemind
from hivemind.averaging import DecentralizedAverager

from p2pdiloco.swarm.averager import ExactAverager
from p2pdiloco.swarm.seams import PINNED, SEAMS

ROOT = Path(__file__).resolve().parents[2]


def test_the_pinned_hivemind_is_the_one_installed_and_the_one_pyproject_asks_for():
    assert hivemind.__version__ == PINNED
    assert f'"hivemind=={PINNED}"' in (ROOT / "pyproject.toml").read_text()


def test_every_seam_names_a_test_that_exists():
    for seam in SEAMS:
        path, _, name = seam.test.partition("::")
        assert re.search(rf"^def {name}\(", (ROOT / path).read_text(), re.M), seam


def is_method(value) -> bool:
    return isinstance(value, (staticmethod, classmethod, property)) or (callable(value) and not inspect.isclass(value))


def test_every_private_method_of_hivemind_we_override_is_listed():
    listed = " ".join(seam.name for seam in SEAMS)
    ours = [cls for cls in ExactAverager.__mro__ if cls.__module__.startswith("p2pdiloco.")]
    # methods only: hivemind's ServicerBase caches `_rpc_handlers` and `_stub_type` on the class at its first
    # stub or handler (a test that ran real averagers in this process has set them); they are not our overrides
    overridden = [name for cls in ours for name, value in vars(cls).items() if name.startswith("_")
                  and not name.startswith("__") and hasattr(DecentralizedAverager, name)
                  and is_method(value)]
    assert overridden and all(name in listed for name in overridden), overridden


def test_every_private_attribute_of_hivemind_we_read_is_listed():
    """`self._x` in the averager's two modules that our own code never sets nor defines comes from hivemind."""
    tree = ast.Module(body=[node for path in ("averager.py", "island_rounds.py")
                            for node in ast.parse((ROOT / "p2pdiloco/swarm" / path).read_text()).body], type_ignores=[])
    ours = {t.attr for node in ast.walk(tree) if isinstance(node, (ast.Assign, ast.AnnAssign))
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            for t in (t.elts if isinstance(t, ast.Tuple) else [t]) if isinstance(t, ast.Attribute)}
    ours |= {node.name for node in ast.walk(tree) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}
    read = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and getattr(node.value, "id", None) == "self" and node.attr.startswith("_")
            and not node.attr.startswith("__")}
    listed = " ".join(seam.name for seam in SEAMS)
    hivemind_own = sorted(read - ours)
    assert hivemind_own and all(name in listed for name in hivemind_own), hivemind_own
