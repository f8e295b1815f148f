"""A weight subscriber in its own process, as an engine host is: ``python -m
tests.weight_subscriber PUB SNAPSHOT VERSION MODEL_DIR OUT``.

Waits for weight version ``VERSION`` (or newer), pulls it into the parameters of the model
in ``MODEL_DIR`` (loaded fresh, as an engine holds it), and writes the loaded state dict to
``OUT`` (safetensors) with the version it got, for the test to compare.
"""

from __future__ import annotations

import asyncio
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from asyncrl.weights.sync import WeightReceiver


async def main(pub: str, snapshot: str, version: int, model_dir: str, out: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    params = model.state_dict()
    async with WeightReceiver(pub, snapshot, puller="subscriber") as rx:
        msg = await asyncio.wait_for(rx.next_version(after=version - 1), 120)
        tensors = await rx.fetch(msg)
    with torch.no_grad():
        for name, t in tensors.items():
            params[name].copy_(t)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k in tensors}
    save_file(state, out, metadata={"version": str(msg.version)})


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]))
