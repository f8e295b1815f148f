"""The design map stays true, and the repository stands on its own: every module is on
``docs/design.md``'s map, the map names no module that is gone, and no file cites notes
that live outside the repository."""

from __future__ import annotations

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
