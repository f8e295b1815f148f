"""Admission rule (1): the arithmetic, worked with real numbers, and its resume behaviour.

    admitted + 1 <= (eta + v + 1) * B + ceil(alpha * B)                              (1)

Each test writes its numbers out, so a change to the formula shows up as a wrong sum.
"""

from __future__ import annotations

import pytest

from asyncrl.buffer.admission import admission_capacity, admission_limit, fair_share
from asyncrl.buffer.versioned import BufferState, VersionedBuffer
from asyncrl.wire.codec import Codec
from tests.buffer_sim import ListSource, finished_group, make_prompts


def capacity(**kw: float | int | None) -> int:
    """``admission_capacity`` with B = 4, eta = 1, alpha = 0, v = 0 unless given."""
    args = {"admitted": 0, "in_flight": 0, "version": 0, "max_staleness": 1, "groups_per_step": 4}
    return admission_capacity(**{**args, **kw})


def test_cold_start_admits_eta_plus_one_steps_and_the_ninth_group_waits_for_v1() -> None:
    # B = 4, eta = 1, v = 0: (1 + 0 + 1) * 4 = 8 groups may be admitted.
    assert admission_limit(version=0, max_staleness=1, groups_per_step=4) == 8
    assert capacity(admitted=0) == 8
    assert capacity(admitted=7, in_flight=7) == 1
    # The ninth group: 8 + 1 > 8, so nothing more until the trainer reaches v = 1 ...
    assert capacity(admitted=8, in_flight=8) == 0
    # ... where (1 + 1 + 1) * 4 = 12: four more (one step's worth).
    assert capacity(admitted=8, in_flight=4, version=1) == 4


def test_eta_zero_is_synchronous_exactly_b_groups_per_version() -> None:
    # eta = 0, B = 4: limit (0 + v + 1) * 4 = 4, 8, 12 at v = 0, 1, 2.
    assert [admission_limit(version=v, max_staleness=0, groups_per_step=4) for v in range(3)] == [
        4,
        8,
        12,
    ]
    # v = 0: exactly B = 4 start, the fifth waits.
    assert capacity(max_staleness=0, admitted=0) == 4
    assert capacity(max_staleness=0, admitted=4, in_flight=4) == 0
    # Trainer consumed those 4 and stepped to v = 1: 8 - 4 = 4 more, again exactly B.
    assert capacity(max_staleness=0, admitted=4, version=1) == 4


@pytest.mark.parametrize(
    ("eta", "expected"),
    [
        # B = 3, v = 0: (1 + 0 + 1) * 3 = 6 with eta = 1, (2 + 0 + 1) * 3 = 9 with eta = 2.
        (1, 6),
        (2, 9),
    ],
)
def test_each_step_of_staleness_admits_one_more_step_of_groups(eta: int, expected: int) -> None:
    assert admission_limit(version=0, max_staleness=eta, groups_per_step=3) == expected
    assert capacity(max_staleness=eta, groups_per_step=3) == expected
    # 5 admitted, eta = 1: 6 - 5 = 1 more; eta = 2: 9 - 5 = 4 more.
    assert capacity(max_staleness=eta, groups_per_step=3, admitted=5) == expected - 5


def test_every_version_adds_b_slots() -> None:
    # B = 4, eta = 1: 8, 12, 16, 20 at v = 0..3 (one step's worth per optimizer step).
    limits = [admission_limit(version=v, max_staleness=1, groups_per_step=4) for v in range(4)]
    assert limits == [8, 12, 16, 20]
    # 10 admitted (8 at v = 0, then 2 at v = 1): v = 1 leaves 12 - 10 = 2, v = 3 leaves 10.
    assert capacity(admitted=10, version=1) == 2
    assert capacity(admitted=10, version=3) == 10


@pytest.mark.parametrize(
    ("alpha", "groups_per_step", "extra"),
    [
        (0.0, 4, 0),  # no APRIL: 0 extra
        (0.5, 4, 2),  # 0.5 * 4 = 2 exactly
        (0.3, 4, 2),  # 0.3 * 4 = 1.2, rounded up to 2
        (0.25, 3, 1),  # 0.25 * 3 = 0.75, rounded up to 1
        (1.0, 3, 3),  # (1 + 1) * 3 = 6 running per step
        # 0.28 * 25 is 7.000000000000001 in floating point; the extra is still 7, not 8.
        (0.28, 25, 7),
        (1.1, 50, 55),  # 1.1 * 50 = 55.00000000000001 in floating point: 55, not 56
    ],
)
def test_over_provision_adds_ceil_alpha_b_groups(
    alpha: float, groups_per_step: int, extra: int
) -> None:
    # eta = 0, v = 0: B + ceil(alpha * B) groups, APRIL's (1 + alpha) * B.
    limit = admission_limit(
        version=0, max_staleness=0, groups_per_step=groups_per_step, over_provision=alpha
    )
    assert limit == groups_per_step + extra


def test_max_in_flight_caps_capacity_below_the_admission_limit() -> None:
    # Limit 8, admitted 2 (both in flight), max_in_flight 3: min(8 - 2, 3 - 2) = 1.
    assert capacity(admitted=2, in_flight=2, max_in_flight=3) == 1
    # The cap counts groups generating, not groups admitted: 6 admitted, 1 in flight,
    # min(8 - 6, 3 - 1) = 2 (the admission room is the binding one here).
    assert capacity(admitted=6, in_flight=1, max_in_flight=3) == 2
    # No cap: the admission room alone, 8 - 2 = 6.
    assert capacity(admitted=2, in_flight=2, max_in_flight=None) == 6


def test_capacity_is_never_negative() -> None:
    # 11 admitted against a limit of 8 (e.g. a run resumed with a smaller B): 0, not -3.
    assert capacity(admitted=11) == 0
    # 5 generating against max_in_flight 3: 0, not -2.
    assert capacity(admitted=5, in_flight=5, max_in_flight=3) == 0


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"version": -1}, "version"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"groups_per_step": 0}, "groups_per_step"),
        ({"over_provision": -0.5}, "over_provision"),
        ({"over_provision": float("nan")}, "over_provision"),
        ({"over_provision": float("inf")}, "over_provision"),
    ],
)
def test_invalid_arguments_raise_a_value_error_naming_the_bound(
    kw: dict[str, float], field: str
) -> None:
    args = {"version": 0, "max_staleness": 1, "groups_per_step": 4, **kw}
    with pytest.raises(ValueError, match=field):
        admission_limit(**args)
    with pytest.raises(ValueError, match=field):
        admission_capacity(admitted=0, in_flight=0, **args)


def test_capacity_after_restore_equals_capacity_at_the_checkpoint() -> None:
    # B = 2, eta = 1, n = 2, zero-variance filter on. At v = 0 the limit is 4.
    cfg = VersionedBuffer.Config(
        groups_per_step=2,
        num_samples_per_prompt=2,
        max_staleness=1,
        filters=["zero_reward_variance"],
    )
    prompts = make_prompts(10)
    buf = VersionedBuffer(cfg, ListSource(prompts))
    items = buf.next_work(10)
    assert len(items) == 4  # limit 4, nothing admitted yet
    # One group is filtered (rewards 1, 1): its slot comes back, so one more is admitted.
    assert buf.put(finished_group(items[0], rewards=[1.0, 1.0])) == "filtered"
    assert buf.put(finished_group(items[1])) == "stored"
    assert buf.put(finished_group(items[2])) == "stored"
    items += buf.next_work(10)
    assert len(items) == 5
    assert buf.take_batch() is not None
    buf.set_version(1)
    # v = 1: limit (1 + 1 + 1) * 2 = 6; holding = 2 consumed + 2 in flight = 4: room 2.
    # The source cursor says 5 prompts were drawn; recomputing "admitted" from it would
    # give 6 - 5 = 1, which is the resume bug the ledger avoids.
    before = buf.capacity()
    assert before == 2
    state = Codec(BufferState).decode(Codec(BufferState).encode(buf.state_dict()))
    restored = VersionedBuffer(cfg, ListSource(prompts))
    restored.load_state_dict(state)
    assert restored.capacity() == before
    # And it admits exactly those 2 new groups, after resuming the 2 that were in flight.
    again = restored.next_work(10)
    assert [i.attempt for i in again] == [2, 2, 1, 1]


def test_the_groups_free_at_a_new_version_are_shared_over_live_producers():
    both = {"a", "b"}
    assert fair_share(available=32, held={}, actor="a", producers=both) == 16
    assert fair_share(available=16, held={"a": 16}, actor="b", producers=both) == 16
    # A producer ahead of its share waits; one behind catches up first.
    assert fair_share(available=8, held={"a": 20, "b": 4}, actor="a", producers=both) == 0
    assert fair_share(available=8, held={"a": 20, "b": 4}, actor="b", producers=both) == 8
    # A producer with full slots stops asking and drops out: its holdings no longer cap
    # the one that asks (else 10 free groups would wait for a producer that cannot take).
    assert fair_share(available=10, held={"a": 40, "b": 20}, actor="a", producers={"a"}) == 10
    # Alone (the other is gone), a producer may take everything.
    assert fair_share(available=32, held={}, actor="a", producers=set()) == 32
    # Odd counts round up, so no group is left with no one to take it.
    assert fair_share(available=3, held={}, actor="a", producers=both) == 2
    assert fair_share(available=1, held={"a": 2}, actor="b", producers=both) == 1
