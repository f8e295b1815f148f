"""The embedded torch engine: continuous batching over a Hugging Face causal LM.

``engine`` (``TorchEngine``), ``requests`` (one request's state and finish rules),
``updates`` (new weight versions into the model), ``kv_batch`` (the running batch's KV
slabs), ``lean_forward`` (its own forward for Llama and Qwen2), ``cpu_linear`` (its
matmuls on the CPU), ``sampling`` (logits to a token and its behaviour log-prob),
``heap_trim`` (memory back to the OS between bursts).
"""
