"""Which workflow a rollout actor runs: the single-turn default or a user's, by dotted path.

slime's ``--custom-generate-function-path``: ``package.module:function`` (or
``package.module.function``) naming ``async def fn(ctx, sample) -> Sample``. A bad path is
refused when the actor starts, naming the path and what is wrong.
"""

from __future__ import annotations

import inspect

from asyncrl.plugins import load_object
from asyncrl.rollout.base import Workflow
from asyncrl.rollout.single_turn import single_turn


def load_workflow(path: str | None) -> Workflow:
    """The workflow at ``path`` (None: ``single_turn``); ``ValueError`` if unusable."""
    if not path:
        return single_turn
    fn = load_object(path, what="workflow")
    # An object whose class defines ``async def __call__`` is a workflow too.
    if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)):
        raise ValueError(f"workflow {path!r} must be an async function (ctx, sample) -> Sample")
    return fn
