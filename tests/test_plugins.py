"""Loading user code by dotted path or by file, with errors that say what failed."""

from __future__ import annotations

from pathlib import Path

import pytest

from asyncrl.plugins import load_object


def test_dotted_paths_and_file_paths_load_the_named_object(tmp_path: Path, monkeypatch):
    assert load_object("asyncrl.plugins:load_object") is load_object
    assert load_object("asyncrl.plugins.load_object") is load_object
    (tmp_path / "agent.py").write_text("CALLS = []\n\ndef run():\n    return 'ran'\n")
    monkeypatch.chdir(tmp_path)
    run = load_object("agent.py:run")
    assert run() == "ran"
    # Imported once per process: a second load is the same module's object.
    assert load_object(f"{tmp_path}/agent.py:CALLS") is load_object("agent.py:CALLS")


@pytest.mark.parametrize(
    ("path", "match"),
    [
        ("nothing", r"must look like 'package.module:name' or 'file.py:name'"),
        ("no_such_module_x:f", r"cannot import 'no_such_module_x'"),
        ("missing.py:f", r"cannot import 'missing.py': no such file"),
        ("asyncrl.plugins:nope", r"'asyncrl.plugins' has no 'nope'"),
        ("broken.py:f", r"cannot import 'broken.py': .*boom"),
        ("syntax.py:f", r"cannot import 'syntax.py': .*invalid syntax"),
    ],
)
def test_a_bad_path_says_what_failed(path: str, match: str, tmp_path: Path, monkeypatch):
    (tmp_path / "broken.py").write_text("raise RuntimeError('boom')\n")
    (tmp_path / "syntax.py").write_text("def (\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=match):
        load_object(path, what="agent")
