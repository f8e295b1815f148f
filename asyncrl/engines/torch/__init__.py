"""The embedded torch engine: continuous batching over a Hugging Face causal LM.

``engine`` (``TorchEngine``), ``kv_batch`` (the running batch's KV slabs), ``lean_forward``
(its own forward for Llama and Qwen2), ``cpu_linear`` (its matmuls on the CPU),
``sampling`` (logits to a token and its behaviour log-prob), ``heap_trim`` (memory back to
the OS between bursts).
"""
