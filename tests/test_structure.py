"""The structure stays as ``docs/design.md`` says: every module is on its map and the map
names none that is gone; no file cites notes that live outside the repository; and no
two packages of ``asyncrl`` import each other, directly or around a loop."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DESIGN = ROOT / "docs" / "design.md"
#: Notes the project started from, outside this repository (a clone does not have them).
OUTSIDE = ("../" + "shared", "DESIGN" + ".md", "reference/" + "sglang_api", "async_" + "anchors")


def modules() -> set[str]:
    return {p.relative_to(ROOT).as_posix() for p in (ROOT / "asyncrl").rglob("*.py")}


def mapped() -> set[str]:
    text = DESIGN.read_text()
    return set(re.findall(r"^\| `(asyncrl/[\w/]+\.py)` \|", text, flags=re.MULTILINE))


def test_every_module_is_on_the_design_map_and_nothing_else_is():
    missing, gone = modules() - mapped(), mapped() - modules()
    assert not missing, f"add these to docs/design.md's module map: {sorted(missing)}"
    assert not gone, f"docs/design.md maps modules that do not exist: {sorted(gone)}"


def tracked_text_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    names = out.stdout.splitlines() if out.returncode == 0 else []
    files = [ROOT / n for n in names] or [
        p for p in ROOT.rglob("*") if ".venv" not in p.parts and ".git" not in p.parts
    ]
    suffixes = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ""}
    return [p for p in files if p.is_file() and p.suffix in suffixes]


def test_no_file_cites_notes_outside_the_repository():
    cited = [
        f"{p.relative_to(ROOT)}: {needle}"
        for p in tracked_text_files()
        if p != Path(__file__).resolve()
        for needle in OUTSIDE
        if needle in p.read_text(errors="replace")
    ]
    assert not cited, cited


def package_imports() -> dict[str, dict[str, set[str]]]:
    """Package -> the packages its modules import at run time -> the importing modules
    (``if TYPE_CHECKING:`` imports are for annotations only and do not count)."""
    root = ROOT / "asyncrl"
    edges: dict[str, dict[str, set[str]]] = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root).parts
        src = parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")
        tree = ast.parse(path.read_text())
        typing_only = {
            id(sub)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for sub in ast.walk(node)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and id(node) not in typing_only:
                module = node.module or ""
                dst = module.split(".")[1] if module.startswith("asyncrl.") else None
                if dst and dst != src:
                    edges.setdefault(src, {}).setdefault(dst, set()).add(path.name)
    return edges


def test_no_two_packages_import_each_other_around_a_loop():
    edges = package_imports()

    def reaches(start: str, goal: str) -> bool:
        seen, todo = set(), [start]
        while todo:
            node = todo.pop()
            if node == goal:
                return True
            if node not in seen:
                seen.add(node)
                todo.extend(edges.get(node, {}))
        return False

    loops = [
        f"{a} -> {b} (in {sorted(files)})"
        for a, targets in edges.items()
        for b, files in targets.items()
        if reaches(b, a)
    ]
    assert not loops, loops


#: Sideways edges: the engines, the rollout workflows and the trainers each stand on the
#: shared layers (``weights``, ``wire``, ``types``, ...) and never on each other, except
#: that rollout drives engines; ``weights`` stands on none of them.
FORBIDDEN = {
    "rollout": {"trainers"},
    "trainers": {"rollout", "engines"},
    "engines": {"rollout", "trainers", "actors"},
    "weights": {"engines", "rollout", "trainers", "actors", "buffer"},
}


def test_engines_rollout_and_trainers_do_not_import_each_other_sideways():
    edges = package_imports()
    sideways = [
        f"{a} -> {b} (in {sorted(edges[a][b])})"
        for a, banned in FORBIDDEN.items()
        for b in sorted(banned & set(edges.get(a, {})))
    ]
    assert not sideways, sideways


def test_actors_read_their_typed_config_not_the_raw_params():
    """Each actor's settings are its ``Config``, validated once in ``Actor.__init__``; the
    raw ``spec.params`` dictionary is read there and nowhere else."""
    readers = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "asyncrl" / "actors").glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\bparams(\.get\(|\[)|spec\.params(?!\))", line.split("#")[0])
    ]
    assert readers == [], readers


#: No module past this; split one by job before it gets there (docs/design.md).
LONG_MODULE = 650


def test_no_module_is_longer_than_650_lines():
    long = [
        f"{path.relative_to(ROOT)} ({n} lines)"
        for path in sorted((ROOT / "asyncrl").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > LONG_MODULE
    ]
    assert not long, f"split these by job: {long}"
