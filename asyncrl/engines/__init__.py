"""Inference engines: the embedded torch engine, its SGLang-compatible HTTP server, and the
SGLang client rollout actors use for every engine (DESIGN section 7).

- ``base``: the records (sampling params, requests, outputs) and the engine protocol.
- ``sampling``: logits to a sampled token and its behaviour log-prob.
- ``torch_engine``: continuous batching over a Hugging Face causal LM with a KV cache.
"""
