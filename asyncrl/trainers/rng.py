"""Every RNG a trainer draws from: seeding, and its state for bit-exact resumes.

Both backends seed at construction and save one state file per rank in their checkpoints
(python ``random``, numpy, torch CPU and, when present, CUDA), as tensors and plain values
that ``torch.load(weights_only=True)`` reads back without unpickling arbitrary objects.
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed python ``random``, numpy and torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Every RNG's state as tensors and plain values (loadable with ``weights_only``)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def load_rng(path: Path) -> dict[str, Any]:
    """``rng_state`` from ``path``; older files that hold a numpy array are read with just
    the numpy types an array needs allowed, still never arbitrary objects."""
    try:
        return torch.load(path, weights_only=True)
    except pickle.UnpicklingError:
        import numpy.dtypes
        from numpy._core.multiarray import _reconstruct

        allowed = [_reconstruct, np.ndarray, np.dtype, numpy.dtypes.UInt32DType]
        with torch.serialization.safe_globals(allowed):
            return torch.load(path, weights_only=True)


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore ``rng_state``'s result."""
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    keys = keys.numpy() if isinstance(keys, torch.Tensor) else keys
    np.random.set_state((kind, keys.astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
