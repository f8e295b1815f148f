"""Inference engines: the embedded torch engine, its SGLang-compatible HTTP server, and the
SGLang client rollout actors use for every engine (``docs/design.md`` section 2).

- ``base``: the records (sampling params, requests, outputs), the engine protocol and
  ``EngineError``.
- ``sampling``: logits to a sampled token, its behaviour log-prob and top alternatives.
- ``torch_engine``: continuous batching over a Hugging Face causal LM with a KV cache;
  ``kv_batch`` holds its left-padded running batch in preallocated slabs,
  ``cpu_linear`` its matmuls on the CPU, ``lean_forward`` its own forward for Llama and
  Qwen2 models, ``weight_loading`` how weights arrive.
- ``sim_engine``: ``SimEngine``, the protocol with no model: random tokens, time from a
  latency model (prefill, per-sequence decode cost, lognormal response lengths), for the
  cluster simulator and load tests.
- ``server``: the aiohttp application, its traffic gate and ``/generate``;
  ``control_routes`` (SGLang section 2), ``openai_routes`` (section 3) and
  ``generate_wire`` (body parsing, reply formatting, error shapes) complete it.
- ``sglang_client``: ``SGLangClient``, holding an ``sglang_transport`` (session, retries,
  engine rotation) and ``sglang_weights`` (weight-update calls), with the records and
  reply parsing of ``sglang_wire``.
- ``in_process``: ``InProcessGenerator``, how workflows call engines in their own
  process: a direct call into the server's ``/generate``, no HTTP.
"""
