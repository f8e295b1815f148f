"""asyncrl: asynchronous actor-model dataflow engine for RL post-training."""

__version__ = "0.1.0"
