"""Training backends: the torch trainer (and megatron-core), and weight publishing.

| module              | what it holds                                                 |
|---------------------|---------------------------------------------------------------|
| ``base``            | the ``Trainer`` protocol and its records                      |
| ``torch_trainer``   | Hugging Face models, AdamW, packed micro-batches, DDP/FSDP    |
| ``learner``         | one trained model: DP wrapper, AdamW, LR schedule, HF weights |
| ``packing``         | token-budget micro-batches and sequence packing               |
| ``parallel``        | DDP / FSDP2 wrapping, gradient sync, full state dicts         |
| ``rollout_tensors`` | a ``TrainBatch`` (or SFT examples) as ``[B, T]`` tensors      |
| ``sft``             | ``asyncrl sft``: data, batches, the supervised loop           |
| ``weight_sync``     | weight versions to engines: pull (chunked) or disk transports |
"""
