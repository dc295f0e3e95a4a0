"""The mutation report of scripts/bench/mutation.sh, from mutmut's results in mutants/: every mutant's status, the
score, and each survivor with its diff and, where it is marked equivalent or accepted in
tests/mutation_equivalent.txt, why. docs/testing.md says how to read it.

    python scripts/bench/mutation_report.py OUT [--root DIR]     (DIR: where mutants/ and pyproject.toml are)

The score counts a timeout or a crash as killed (the mutant made the tests hang or die: they noticed), and a
mutant that no selected test runs ("no tests") as a survivor: code the tests never reach is code they cannot
defend.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MARKS = ROOT / "tests" / "mutation_equivalent.txt"
KILLED = {"killed", "timeout", "caught by type check", "segfault"}  # the tests noticed: failed, hung or crashed


def statuses(root: Path) -> dict[str, str]:
    """Mutant name → mutmut's status, from the .meta files beside the mutated sources."""
    from mutmut.stats import status_by_exit_code

    out = {}
    for meta in sorted((root / "mutants").rglob("*.py.meta")):
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            out[name] = status_by_exit_code[code]
    return out


def marks(path: Path = MARKS) -> dict[str, tuple[str, str]]:
    """Mutant name → (equivalent|accepted, why): lines `NAME  equivalent|accepted  WHY` (# starts a comment)."""
    out = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        line = line.split(" #", 1)[0].strip()
        if line and not line.startswith("#"):
            name, kind, why = re.split(r"\s+", line, maxsplit=2)
            if kind not in ("equivalent", "accepted"):
                raise SystemExit(f"{path}: {name}: the kind must be 'equivalent' or 'accepted', not {kind!r}")
            out[name] = (kind, why)
    return out


def diff(root: Path, name: str) -> str:
    shown = subprocess.run([sys.executable, "-m", "mutmut", "show", name], cwd=root, capture_output=True, text=True)
    return "\n".join(line for line in shown.stdout.splitlines()[1:] if line.startswith(("+", "-", "@@")) and
                     not line.startswith(("+++", "---")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--root", type=Path, default=ROOT)
    parser.add_argument("--no-diffs", action="store_true", help="List the survivors without their diffs (faster).")
    parser.add_argument("--compare", type=Path, help="Another run's root (before a change): both scores on the "
                                                     "mutants both runs checked, by the same name.")
    a = parser.parse_args()
    found, marked = statuses(a.root), marks()
    if not found:
        raise SystemExit(f"no mutmut results under {a.root / 'mutants'}: run scripts/bench/mutation.sh first")
    counts = Counter(found.values())
    survivors = sorted(n for n, s in found.items() if s not in KILLED)
    equivalent = [n for n in survivors if marked.get(n, ("",))[0] == "equivalent"]
    killed = sum(counts[s] for s in KILLED)
    scored = len(found) - len(equivalent)
    by_layer = Counter((n.split(".")[1], found[n] in KILLED) for n in found if n not in equivalent)
    lines = [f"mutants: {len(found)}  " + ", ".join(f"{s}: {c}" for s, c in counts.most_common()),
             f"marked equivalent: {len(equivalent)}; accepted survivors: "
             f"{sum(marked.get(n, ('',))[0] == 'accepted' for n in survivors)}",
             f"score: {killed}/{scored} = {100 * killed / max(scored, 1):.1f} % of the non-equivalent mutants killed"]
    for layer in sorted({layer for layer, _ in by_layer}):
        k, s = by_layer[(layer, True)], by_layer[(layer, False)]
        lines.append(f"  {layer}: {k}/{k + s} = {100 * k / max(k + s, 1):.1f} %")
    unchecked = [n for n, st in found.items() if st == "not checked"]
    if unchecked:
        lines.append(f"not checked yet: {len(unchecked)} (the run was stopped); the score counts them as survivors")
        checked = {n: st for n, st in found.items() if st != "not checked" and n not in equivalent}
        k = sum(st in KILLED for st in checked.values())
        lines.append(f"score of the checked mutants: {k}/{len(checked)} = {100 * k / max(len(checked), 1):.1f} %")
    if a.compare:
        other = statuses(a.compare)
        both = [n for n in found if n in other and "not checked" not in (found[n], other[n])]
        for label, run in (("this run", found), ("compared run", other)):
            k = sum(run[n] in KILLED for n in both)
            lines.append(f"{label} on the {len(both)} mutants both checked: {k} killed = {100 * k / max(len(both), 1):.1f} %")
    stale = sorted(set(marked) - set(found))
    if stale:
        lines.append(f"marks naming no mutant (the code moved: look again): {', '.join(stale)}")
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "summary.txt").write_text("\n".join(lines) + "\n")
    with (a.out / "survivors.txt").open("w") as f:
        for name in survivors:
            kind, why = marked.get(name, ("", ""))
            f.write(f"## {name}: {found[name]}" + (f"  [{kind}: {why}]" if kind else "") + "\n")
            f.write(("" if a.no_diffs else diff(a.root, name) + "\n") + "\n")
    print("\n".join(lines))
    print(f"survivors and their diffs: {a.out / 'survivors.txt'}")


if __name__ == "__main__":
    main()
