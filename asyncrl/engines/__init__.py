"""Inference engines, by component (``docs/design.md`` section 2).

- ``base``: the records (sampling params, requests, outputs) and the ``InferenceEngine``
  protocol that the server, the rollout actor and the tests are typed against.
- ``config``: ``EngineConfig`` (``rollout.engine``, ``asyncrl serve``'s engine flags).
- ``sglang_wire``: SGLang's records and reply parsing, shared by the server and client.
- ``context_bound``: how much of a context a request may use.
- ``torch/``: the embedded engine (``TorchEngine``); weights arrive through
  ``asyncrl/weights/loading.py``.
- ``server/``: the SGLang- and OpenAI-compatible HTTP server around an engine.
- ``client/``: ``SGLangClient``, what rollout actors call every engine with.
- ``vllm/``: vLLM as an engine, in its own interpreter.
- ``sim/``: ``SimEngine``, no model, time from a latency model.
"""
