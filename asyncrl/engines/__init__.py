"""Inference engines, by component (``docs/design.md`` section 2 maps the modules).

``base`` holds the records and the ``InferenceEngine`` protocol every engine meets; the
engines (``torch/`` embedded, ``vllm/``, ``sim/``) sit behind one SGLang-compatible
``server/``, and ``client/`` is what rollout actors call every engine with.
"""
