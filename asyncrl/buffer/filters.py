"""Dynamic-sampling filters: drop finished groups that would teach the trainer nothing.

A filter maps a group to a reason to drop it, or None to keep it: the built-in
``zero_reward_variance`` (equal rewards make every GRPO advantage zero; DAPO's dynamic
sampling) or a callable by dotted path (``mypkg.filters:too_short``). A filter that
raises fails the group, with its name and the exception, rather than drop it silently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from asyncrl.plugins import load_object
from asyncrl.types import Group

GroupFilter = Callable[[Group], str | None]


def zero_reward_variance(group: Group) -> str | None:
    """Drop a group of two or more samples whose rewards are all equal."""
    rewards = group.rewards
    if len(rewards) < 2 or np.isnan(rewards).any():
        return None
    return "zero_reward_variance" if np.ptp(rewards) == 0 else None


FILTERS: dict[str, GroupFilter] = {"zero_reward_variance": zero_reward_variance}


def load_filter(name: str) -> GroupFilter:
    """A built-in filter by name, or a callable ``group -> str | None`` by dotted path."""
    if name in FILTERS:
        return FILTERS[name]
    fn = load_object(name, what="filter")
    if not callable(fn):
        raise ValueError(f"filter {name!r} is not callable")
    return fn


class FilterFailed(Exception):
    """A user filter raised; ``str()`` is the reason recorded for the group."""


def apply_filters(group: Group, filters: Sequence[tuple[str, GroupFilter]]) -> str | None:
    """The first drop reason any filter gives, or None; raises ``FilterFailed``."""
    for name, fn in filters:
        try:
            reason = fn(group)
        except Exception as exc:  # user code
            raise FilterFailed(f"filter {name} raised {type(exc).__name__}: {exc}") from exc
        if reason:
            return str(reason)
    return None
