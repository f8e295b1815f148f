"""Runtimes start actors (local child processes or Ray actors); the supervisor watches
them, turns deaths into errors with the evidence, and restarts by role policy.
"""
