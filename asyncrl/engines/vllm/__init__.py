"""vLLM as an engine: ``engine`` (the client side), ``launch`` (vLLM's interpreter,
command line and environment) and ``ext`` (the worker extension vLLM loads). Importing
this package imports nothing of vLLM's: it runs in its own interpreter.
"""
