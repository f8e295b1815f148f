"""Admission control: how many prompt groups may be generating or waiting, as pure arithmetic.

Principle 4 of ``docs/design.md``: staleness is bounded by *admission*, not by discarding finished
work. With ``B`` groups per train step, max staleness ``eta`` and trainer version ``v``
(optimizer steps applied), a new group may start only while::

    admitted + 1 <= (eta + v + 1) * B  +  ceil(alpha * B)                          (1)

where ``admitted`` counts groups that are in flight, waiting as partials, buffered or
consumed; groups that were filtered or failed give their slot back (otherwise dynamic
sampling would starve generation). ``alpha`` is APRIL's over-provisioning factor: up to
``alpha * B`` extra groups run so that the slowest (longest) ones do not stall a step.
Synchronously (``eta = 0``) the extras are aborted once ``B`` are done and resume first
at the next version; asynchronously they run on into the next steps (``VersionedBuffer``).

Why (1) bounds staleness: groups are served oldest-first, so the ``k``-th admitted group
is trained at version about ``floor((k - 1) / B)``; (1) admits it at version
``v >= ceil(k / B) - eta - 1``, so its head staleness is at most ``eta`` (plus the
reordering that out-of-order completion causes, which the buffer's backstop filter at
``eta_hard`` catches). Worked example, ``B = 4``, ``eta = 1``, ``alpha = 0``: at ``v = 0``
eight groups may be admitted; the ninth waits until the trainer reaches ``v = 1``.

Cold start, ``eta = 0``: only ``B`` groups, which is the synchronous baseline. Resume:
``admitted`` is restored from the checkpoint together with ``v`` (it must not be
recomputed from the data cursor, which also counts filtered prompts).

Several producers. What (1) lets start is shared so that in-flight work evens out over
the producers that are asking (``fair_share``): the first to ask at a new version would
otherwise take every group, and the others' engines would idle through the step.

Users: ``VersionedBuffer`` (``asyncrl.buffer.versioned``) and the buffer actor. No I/O, no
locks, no clock.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping


def admission_limit(
    *, version: int, max_staleness: int, groups_per_step: int, over_provision: float = 0.0
) -> int:
    """The most groups that may be admitted (live or consumed) at trainer ``version``: (1)."""
    bad_alpha = not (math.isfinite(over_provision) and over_provision >= 0)
    if version < 0 or max_staleness < 0 or groups_per_step < 1 or bad_alpha:
        raise ValueError(
            f"need version >= 0, max_staleness >= 0, groups_per_step >= 1, "
            f"over_provision finite and >= 0; got {version}, {max_staleness}, {groups_per_step}, "
            f"{over_provision}"
        )
    # Rounded first: 0.28 * 25 is 7.000000000000001 in floats, and ceil would make it 8.
    extra = math.ceil(round(over_provision * groups_per_step, 9))
    return (max_staleness + version + 1) * groups_per_step + extra


def admission_capacity(
    *,
    admitted: int,
    in_flight: int,
    version: int,
    max_staleness: int,
    groups_per_step: int,
    over_provision: float = 0.0,
    max_in_flight: int | None = None,
) -> int:
    """How many more groups may start now (never negative).

    ``admitted`` as in (1); ``in_flight`` groups currently generating, capped by
    ``max_in_flight`` (the engines' concurrency) when given.
    """
    room = (
        admission_limit(
            version=version,
            max_staleness=max_staleness,
            groups_per_step=groups_per_step,
            over_provision=over_provision,
        )
        - admitted
    )
    if max_in_flight is not None:
        room = min(room, max_in_flight - in_flight)
    return max(room, 0)


def fair_share(
    *, available: int, held: Mapping[str, int], actor: str, producers: Collection[str]
) -> int:
    """How many of the ``available`` groups ``actor`` may take now, so that the groups in
    flight even out over the live ``producers`` (``actor`` counts among them)::

        share = ceil((sum_p held[p] + available) / n) - held[actor]   in [0, available]

    with ``n`` the number of producers. Example: 32 groups free at a new version, two
    idle producers: each gets 16, whichever asks first.
    """
    names = set(producers) | {actor}
    total = sum(held.get(p, 0) for p in names) + available
    share = math.ceil(total / len(names)) - held.get(actor, 0)
    return max(0, min(share, available))
