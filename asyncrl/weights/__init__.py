"""Weight versions from the trainer to the engines: every transport and format.

It depends on ``wire``, ``observe`` and ``errors`` only: the trainers, the engines and the
rollout actors all use it, and none of them imports another for weights.
"""
