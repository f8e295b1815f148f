"""Takes shared weight versions in its own process, as an engine on the trainer's host
does: ``python -m tests.shared_taker`` reads ``[version, handles]`` lines on stdin and
answers each with ``{"version", "sum"}`` (or ``{"error"}``) on stdout."""

from __future__ import annotations

import json
import sys

import torch

from asyncrl.weights.share import take_shared


def main() -> None:
    for line in sys.stdin:
        version, handles = json.loads(line)
        total = torch.zeros((), dtype=torch.float64)

        def add(name: str, view: torch.Tensor, total: torch.Tensor = total) -> None:
            total.add_(view.double().sum())

        try:
            take_shared(handles, version, add)
        except Exception as exc:
            print(json.dumps({"error": repr(exc)}), flush=True)
        else:
            print(json.dumps({"version": version, "sum": float(total)}), flush=True)


if __name__ == "__main__":
    main()
