"""Errors that say the job's input is wrong, as opposed to something having gone wrong.

An ``InputError`` (bad data, config or user code; ``DataError``, ``ConfigError``,
``PreflightError`` and the plugin loader's ``PluginError`` are ones) recurs however often
the actor that hit it is restarted, so an actor failing with one says so in its ``Bye``
(``actors/base.py::is_permanent``) and the supervisor ends the job with the reason
instead of restarting it. So are state the run directory lost (``RunStateLost``), a
checkpoint that cannot be read (``CheckpointUnreadable``) and samples that keep failing
(``SamplesFailing``). Anything else (a lost peer, a timeout, out of memory) may pass and
is restarted within the budget.
"""

from __future__ import annotations


class InputError(ValueError):
    """The job's input is wrong in a way a restart would only repeat."""


class RunStateLost(InputError):
    """The run directory lost state the job needs to go on exactly (a checkpoint or a
    journal deleted or moved while the job ran): going on would serve consumed work again,
    and a restart would find the same directory."""


class SamplesFailing(InputError):
    """Most samples fail (``buffer.max_failed_share``): the data, the reward or agent code,
    or the sampling settings are wrong, and going on would train nothing."""


class CheckpointUnreadable(InputError):
    """A checkpoint the job must load is truncated or not one: a restart would read the
    same bytes again."""


class NonFiniteTraining(InputError):
    """Training produces NaN or infinite values step after step (a reward, a learning rate
    or data out of range): going on, or a restart, would only write broken weights."""
