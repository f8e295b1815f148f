"""What CurveZMQ costs on the wire, side by side in one run: each channel plain and encrypted.

    python bench/curve.py [--messages 100000] [--payload-mb 64] [--repeats 3]

The two transfers of ``bench/wire.py``, between two processes, each run plain and with
CurveZMQ (``--wire.curve-keys``: a job certificate made in a temp folder, CURVE on both
processes' sockets, the ZAP handler admitting the job key), alternately ``--repeats``
times; the median of each and the ratio encrypted / plain are reported:

1. **records**: ~1 KB ``Sample`` records through the reliable channel (messages/s);
2. **blob**: ``--payload-mb`` of tensors pulled through the chunked blob pull (MB/s), as
   a weight update does.

Writes ``bench/results/curve.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asyncrl.observe.logs import configure_logging
from asyncrl.wire import security
from bench.wire import CURVE_ENV, blob_pull, reliable_records


def measure(curve_keys: str | None, args: argparse.Namespace) -> dict[str, float]:
    """Both transfers, plain (``curve_keys`` None) or encrypted."""
    if curve_keys:
        os.environ[CURVE_ENV] = curve_keys
        security.enable(curve_keys)
    try:
        return {
            "records/s": reliable_records(args.messages, "sample"),
            "blob MB/s": blob_pull(args.payload_mb * 1024 * 1024) / 1e6,
        }
    finally:
        os.environ.pop(CURVE_ENV, None)
        security.disable()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--messages", type=int, default=100_000)
    ap.add_argument("--payload-mb", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("bench/results/curve.json"))
    args = ap.parse_args()
    configure_logging(level="warning")
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "curve": []}
    with tempfile.TemporaryDirectory(prefix="curve-") as tmp:
        security.generate(Path(tmp) / "keys")
        for rep in range(args.repeats):
            for mode in runs:
                print(f"{mode} ({rep + 1}/{args.repeats}) ...", flush=True)
                runs[mode].append(
                    measure(str(Path(tmp) / "keys") if mode == "curve" else None, args)
                )
    medians = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    print(f"\n{'transfer':<12}{'plain':>12}{'curve':>12}{'curve / plain':>16}")
    for k in medians["plain"]:
        plain, curve = medians["plain"][k], medians["curve"][k]
        print(f"{k:<12}{plain:>12.0f}{curve:>12.0f}{curve / plain:>16.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    payload = {"messages": args.messages, "payload_mb": args.payload_mb, "repeats": args.repeats,
               "medians": medians, "runs": runs}  # fmt: skip
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
