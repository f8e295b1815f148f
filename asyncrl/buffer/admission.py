"""Admission control: how many prompt groups may be generating or waiting, as pure arithmetic.

Staleness is bounded by *admission*, not by discarding finished work (``docs/design.md``
section 5). With ``B`` groups per step, max staleness ``eta``, APRIL's over-provisioning
``alpha`` and trainer version ``v``, a new group may start only while::

    admitted + 1 <= (eta + v + 1) * B  +  ceil(alpha * B)                          (1)

``admitted`` counts groups in flight, partial, buffered or consumed; a filtered or failed
group gives its slot back (else dynamic sampling would starve generation). On resume it
comes from the checkpoint, never from the data cursor (which counts filtered prompts too).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping


def admission_limit(
    *, version: int, max_staleness: int, groups_per_step: int, over_provision: float = 0.0
) -> int:
    """The most groups that may be admitted (live or consumed) at trainer ``version``: (1).

    With ``B = 4``, ``eta = 1``, ``alpha = 0``: eight groups at ``v = 0``; the ninth waits
    for ``v = 1``. A cold start with ``eta = 0`` admits ``B``: the synchronous baseline.
    """
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

    with ``n`` the number of producers. Otherwise the first to ask at a new version would
    take every group, and the others' engines would idle through the step.
    """
    names = set(producers) | {actor}
    total = sum(held.get(p, 0) for p in names) + available
    share = math.ceil(total / len(names)) - held.get(actor, 0)
    return max(0, min(share, available))
