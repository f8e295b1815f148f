"""Reading prompt files into rows: JSON lines, a JSON array, parquet, a saved HF dataset.

``read_raw_rows`` gives ``(where, row)``: ``where`` is ``file:line`` for JSON lines and
``file row N`` (1-based) otherwise. Every problem is a ``DataError`` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.errors import InputError

_FORMATS = {".jsonl": "jsonl", ".json": "jsonl", ".parquet": "parquet"}


class DataError(InputError):
    """Bad prompt data or a resume state that does not fit it; names file, line and problem."""


def read_bytes(file: str) -> bytes:
    """The file's bytes, which identify the data (its hash); for a saved dataset, its
    Arrow files' bytes joined."""
    path = Path(file)
    if path.is_dir():
        return b"".join(f.read_bytes() for f in _arrow_files(path))
    if path.suffix.lower() not in _FORMATS:
        raise DataError(
            f"{file}: unknown format {path.suffix!r}, expected one of {', '.join(_FORMATS)}"
        )
    if not path.is_file():
        raise DataError(f"{file}: no such file")
    return path.read_bytes()


def read_raw_rows(file: str, data: bytes) -> list[tuple[str, Any]]:
    """``(where, row)`` per row; a jsonl row is still undecoded bytes, parsed when selected.

    ``.jsonl``, and ``.json`` that is not an array, are JSON lines; blank lines are skipped
    but counted, so ``where`` gives an editor's line number."""
    if Path(file).is_dir():
        return _arrow_rows(file)
    if _FORMATS[Path(file).suffix.lower()] == "parquet":
        return _parquet_rows(file, data)
    if Path(file).suffix.lower() == ".json" and data.lstrip()[:1] == b"[":
        return _json_array_rows(file, data)
    lines = enumerate(data.split(b"\n"), 1)
    return [(f"{file}:{n}", line) for n, line in lines if line.strip()]


def _parquet_rows(file: str, data: bytes) -> list[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(pa.BufferReader(data))
    except pa.ArrowException as exc:
        raise DataError(f"{file}: not a readable parquet file: {exc}") from exc
    return [(f"{file} row {n}", row) for n, row in enumerate(table.to_pylist(), 1)]


def _json_array_rows(file: str, data: bytes) -> list[tuple[str, Any]]:
    """A ``.json`` file holding one array of row objects (``row N``, 1-based)."""
    try:
        rows = json.loads(data)
    except ValueError as exc:
        raise DataError(f"{file}: not valid JSON: {exc}") from None
    return [(f"{file} row {n}", row) for n, row in enumerate(rows, 1)]


def _arrow_files(folder: Path) -> list[Path]:
    """The Arrow files of a Hugging Face ``datasets`` folder (``save_to_disk``), in order."""
    if (folder / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
        raise DataError(f"{folder}: a dataset with splits {splits}: name one, e.g. {folder}/train")
    state = folder / "state.json"
    if not state.is_file():
        raise DataError(f"{folder}: a folder, but not a saved datasets dataset (no state.json)")
    try:
        files = [folder / f["filename"] for f in json.loads(state.read_text())["_data_files"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{state}: unreadable ({type(exc).__name__}: {exc})") from None
    if missing := [f.name for f in files if not f.is_file()]:
        raise DataError(f"{folder}: data files missing: {missing}")
    return files


def _arrow_rows(folder: str) -> list[tuple[str, Any]]:
    """A saved ``datasets`` folder's rows, read with pyarrow (``datasets`` not needed)."""
    import pyarrow as pa

    rows: list[Any] = []
    for file in _arrow_files(Path(folder)):
        try:
            with pa.memory_map(str(file)) as source:
                rows += pa.ipc.open_stream(source).read_all().to_pylist()
        except pa.ArrowException as exc:
            raise DataError(f"{file}: not a readable Arrow stream: {exc}") from exc
    return [(f"{folder} row {n}", row) for n, row in enumerate(rows, 1)]
