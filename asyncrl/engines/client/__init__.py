"""The SGLang client rollout actors use for every engine.

``sglang`` (``SGLangClient``), ``transport`` (session, retries, engine rotation),
``weights`` (SGLang's weight-update calls).
"""
