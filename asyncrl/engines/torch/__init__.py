"""The embedded torch engine (``TorchEngine``): continuous batching over a Hugging Face
causal LM, one module per job (``docs/design.md``'s module map names them).
"""
