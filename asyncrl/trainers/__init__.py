"""Training backends: the torch trainer and megatron-core (weight publishing is ``weights/``).

``create_trainer`` (``backends``) builds the backend a ``TrainerConfig`` (``config``) names,
on its ranks; every backend follows the ``Trainer`` protocol (``base``). Each module's job
is on the module map in ``docs/design.md``.
"""
