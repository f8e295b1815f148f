"""Training backends: the torch trainer (and megatron-core), and weight publishing.

| module            | what it holds                                                  |
|-------------------|----------------------------------------------------------------|
| ``base``          | the ``Trainer`` protocol and its records                       |
| ``torch_trainer`` | Hugging Face models, AdamW, packed micro-batches, DDP          |
| ``packing``       | token-budget micro-batches and sequence packing                |
| ``weight_sync``   | weight versions to engines: pull (chunked) or disk transports  |
"""
