"""A stand-in ``sglang`` package for tests: the real SGLang server needs a GPU.

Only ``python -m sglang.launch_server`` exists, and it serves asyncrl's own
SGLang-compatible engine (``asyncrl serve``), so the engine actor's launcher (process
group, health wait, output, stop) runs against a real HTTP server.
"""
