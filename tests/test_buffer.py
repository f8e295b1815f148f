"""VersionedBuffer: APRIL partials, requeues, failures, staleness, checkpoints, and a property
test that plays producers and a trainer against it in random order.

The property test keeps its own model of where every prompt is and checks, after every
step, that the buffer agrees: no prompt lost or repeated (docs/design.md, principle 6), staleness
within the backstop (principle 4), whole groups only, and the age guarantee.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.buffer import april
from asyncrl.buffer.accounting import (
    MAX_REASON_CHARS,
    MAX_REASONS,
    OTHER,
    Ledger,
    LedgerError,
    Live,
)
from asyncrl.buffer.admission import admission_limit
from asyncrl.buffer.sources import PromptSource
from asyncrl.buffer.store import PRIORITIES
from asyncrl.buffer.versioned import BufferState, VersionedBuffer
from asyncrl.types import Group, Sample, SampleStatus, WorkItem
from asyncrl.wire.codec import Codec
from tests.buffer_sim import (
    ListSource,
    aborted_group,
    failed_group,
    finished_group,
    make_prompts,
    over_the_wire,
    start_samples,
)

STATE_CODEC: Codec[BufferState] = Codec(BufferState)


def through_codec(state: BufferState) -> BufferState:
    """A checkpoint as it comes back from disk: encoded and decoded."""
    return STATE_CODEC.decode(STATE_CODEC.encode(state))


def buffer(n: int = 8, **config: object) -> VersionedBuffer:
    """A buffer over ``n`` listed prompts (``p0``, ``p1``, ...)."""
    return VersionedBuffer(VersionedBuffer.Config(**config), ListSource(make_prompts(n)))


def handed_out(buf: VersionedBuffer, k: int) -> list[WorkItem]:
    """``next_work(k)`` as a producer receives it (over the wire)."""
    return [over_the_wire(i) for i in buf.next_work(k)]


# -- the ledger ----------------------------------------------------------------------------
def test_the_ledger_refuses_transitions_from_the_wrong_state() -> None:
    ledger = Ledger()
    ledger.admit("g")
    with pytest.raises(LedgerError, match="admitted twice"):
        ledger.admit("g")
    with pytest.raises(LedgerError, match="g is in_flight, expected buffered"):
        ledger.consume("g")
    ledger.move("g", Live.BUFFERED, expect=(Live.IN_FLIGHT,))
    ledger.consume("g")
    with pytest.raises(LedgerError, match="g is not live"):
        ledger.fail("g", "boom", expect=(Live.IN_FLIGHT, Live.PARTIAL))
    ledger.check()
    assert (ledger.admitted, ledger.consumed, ledger.holding) == (1, 1, 1)


def test_the_ledger_check_catches_counts_that_do_not_add_up() -> None:
    ledger = Ledger()
    ledger.admit("a")
    ledger.admit("b")
    ledger.filter("a", "stale", expect=(Live.IN_FLIGHT,))
    ledger.check()
    # Filtered and failed groups give their admission slot back; consumed ones do not.
    assert ledger.holding == 1
    state = json.loads(json.dumps(ledger.state_dict()))
    state["admitted"] = 3  # one group vanished from every state
    with pytest.raises(LedgerError, match="does not add up"):
        Ledger().load_state_dict(state)


def test_failure_reasons_stay_bounded_and_every_group_is_still_counted() -> None:
    ledger = Ledger()
    for i in range(100):  # an engine error that names its request: every text differs
        ledger.admit(f"g{i}")
        ledger.fail(
            f"g{i}", f"EngineError: rid=req-{i} timed out " + "x" * 300, expect=(Live.IN_FLIGHT,)
        )
    ledger.check()
    counts = ledger.counts()
    assert len(counts.failed) == MAX_REASONS + 1 and counts.failed[OTHER] == 100 - MAX_REASONS
    assert sum(counts.failed.values()) == 100
    assert all(len(reason) <= MAX_REASON_CHARS for reason in counts.failed)


# -- APRIL ----------------------------------------------------------------------------------
def test_april_over_provisions_aborts_the_extras_and_resumes_them_first() -> None:
    # B = 2, alpha = 0.5, eta = 0: 2 + ceil(0.5 * 2) = 3 groups run in step 0.
    buf = buffer(groups_per_step=2, num_samples_per_prompt=2, max_staleness=0, over_provision=0.5)
    items = handed_out(buf, 10)
    assert [i.group_uid for i in items] == ["p0", "p1", "p2"]
    assert buf.put(finished_group(items[0])) == "stored"
    assert not buf.should_abort()  # 1 of B done
    assert buf.put(finished_group(items[1])) == "stored"
    assert buf.should_abort()  # B done and p2 still generating: abort it
    # p2 was cut off: sample 0 after 2 tokens, sample 1 had finished with 3.
    aborted = aborted_group(items[2], versions=[0, 0], aborted=[0], finished_versions=[0, 0, 0])
    assert buf.put(aborted) == "partial"
    assert not buf.should_abort()
    assert (buf.statistics().ledger.partial, buf.statistics().ledger.buffered) == (1, 2)
    # Synchronous: the step is done, so p2 waits for the next version (resumed now, it
    # would run to its end before a colocated step could start).
    assert handed_out(buf, 10) == [] and buf.available() == 0

    batch = buf.take_batch()
    assert batch is not None and [g.uid for g in batch.groups] == ["p0", "p1"]
    buf.set_version(1)
    # v = 1: limit 2 * 2 + 1 = 5, holding 2 consumed + p2 = 3: p2 resumed first, then 2 new.
    resumed, *fresh = handed_out(buf, 10)
    assert (resumed.group_uid, resumed.attempt, resumed.version) == ("p2", 2, 1)
    assert [i.group_uid for i in fresh] == ["p3", "p4"]
    assert [i.attempt for i in fresh] == [1, 1]
    assert resumed.partial is not None
    first, second = resumed.partial.samples
    assert (first.status, first.response_tokens.tolist()) == (SampleStatus.ABORTED, [100, 101])
    assert (second.status, second.response_length) == (SampleStatus.COMPLETED, 3)
    # Resuming with max_new_tokens = 5: 2 generated, 3 to go.
    assert april.remaining_tokens(first.response_length, 5) == 3


def test_a_synchronous_april_step_that_is_done_starts_nothing_new_until_the_next_version():
    buf = buffer(groups_per_step=2, num_samples_per_prompt=2, max_staleness=0,
                 over_provision=0.5, filters=["zero_reward_variance"])  # fmt: skip
    a, b, c = handed_out(buf, 3)  # (0 + 0 + 1) * 2 + ceil(0.5 * 2)
    assert buf.put(finished_group(a)) == "stored"
    assert buf.put(finished_group(b)) == "stored"
    # c ends with equal rewards and gives its slot back; eta 0 must not start a group
    # in it now: it would generate during the step and be trained a version late.
    assert buf.put(finished_group(c, rewards=[1.0, 1.0])) == "filtered"
    assert buf.capacity() == 0 and handed_out(buf, 3) == []
    assert buf.take_batch() is not None
    buf.set_version(1)
    assert [i.group_uid for i in handed_out(buf, 9)] == ["p3", "p4", "p5"]


def test_groups_kept_for_reuse_do_not_trigger_an_april_abort() -> None:
    # B = 1, alpha = 1, eta = 0, reuse 2: (0 + 0 + 1) * 1 + 1 = 2 groups at v = 0.
    buf = buffer(
        groups_per_step=1, num_samples_per_prompt=2, max_staleness=0, over_provision=1.0,
        max_reuse=2,
    )  # fmt: skip
    a, _ = handed_out(buf, 2)
    assert buf.put(finished_group(a)) == "stored"
    assert buf.should_abort()  # B = 1 finished, one still generating
    assert buf.take_batch() is not None
    # p0 stays in the store for a second serving, but nothing new has finished: aborting
    # the group still generating now would throw its step away.
    assert len(buf.store) == 1
    assert not buf.should_abort()


def test_async_april_never_aborts_for_a_step_and_cuts_only_what_turned_too_stale() -> None:
    # B = 1, eta = 1 (backstop 2), alpha = 1: (1 + 0 + 1) * 1 + 1 = 3 groups at v = 0.
    buf = buffer(groups_per_step=1, num_samples_per_prompt=2, over_provision=1.0)
    a, b, c = handed_out(buf, 3)
    assert buf.put(finished_group(a)) == "stored"
    # A step's worth is done while b and c generate: they go on into the next steps.
    assert not buf.should_abort()
    assert buf.put(aborted_group(b, versions=[0, 0], aborted=[0], finished_versions=[0])) == (
        "partial"
    )
    assert buf.take_batch() is not None
    assert buf.set_version(1) == []
    (d,) = handed_out(buf, 1)  # the pool first: b resumes at v = 1 with its v = 0 tokens
    assert (d.group_uid, d.version) == ("p1", 1)
    (e,) = handed_out(buf, 1)
    assert (e.group_uid, e.version) == ("p3", 1)
    assert buf.set_version(2) == []  # heads 0 and 1: staleness 2 is within the backstop
    capacity = buf.capacity()
    # At v = 3 anything headed at v = 0 can only land past the backstop (3 - 0 > 2): c,
    # handed out at 0, and b, resumed at 1 but holding tokens from 0. e (head 1) goes on.
    assert buf.set_version(3) == ["p1", "p2"]
    assert buf.in_flight == ["p3"] and buf.cancelled == ["p1", "p2"]
    assert buf.capacity() == capacity + 1 + 2  # a step's B, and their slots back
    assert buf.statistics().ledger.filtered == {"cut": 2}  # apart from the backstop's "stale"
    # The producers abort them; what comes back is neither stored nor a duplicate.
    assert buf.put(aborted_group(c, versions=[0, 1], aborted=[0, 1])) == "cancelled"
    assert buf.put(aborted_group(c, versions=[0, 1], aborted=[0, 1])) == "duplicate"
    restored = buffer(groups_per_step=1, num_samples_per_prompt=2, over_provision=1.0)
    restored.load_state_dict(through_codec(buf.state_dict()))
    assert restored.cancelled == ["p1"]  # still expected after a restart
    assert restored.put(finished_group(d, versions=[3])) == "cancelled"
    assert restored.statistics().duplicates == 1 and restored.cancelled == []
    assert restored.put(finished_group(e, versions=[3])) == "stored"
    restored.ledger.check()
    # A cut group whose producer then died sends nothing back: it is not waited for.
    assert buf.cancelled == ["p1"]
    assert buf.requeue(["p1"]) == 0 and buf.cancelled == []


def test_async_april_drops_a_waiting_partial_too_stale_to_resume() -> None:
    buf = buffer(groups_per_step=1, num_samples_per_prompt=1, over_provision=1.0)
    a, b, _ = handed_out(buf, 3)
    assert buf.put(finished_group(a)) == "stored"
    assert buf.put(aborted_group(b, versions=[0], aborted=[0])) == "partial"
    assert buf.take_batch() is not None
    assert buf.set_version(2) == []
    assert len(buf.pool) == 1
    assert buf.set_version(3) == ["p2"]  # the pool's b is dropped, not resumed
    assert len(buf.pool) == 0 and buf.cancelled == ["p2"]
    assert buf.statistics().ledger.filtered == {"cut": 2}


def test_april_with_a_backstop_of_zero_is_refused_before_anything_runs() -> None:
    # A resumed partial always lands at least a version old: all would be dropped.
    with pytest.raises(ValueError, match="hard_staleness 0 with over_provision"):
        VersionedBuffer.Config(max_staleness=0, hard_staleness=0, over_provision=0.5)
    VersionedBuffer.Config(max_staleness=0, over_provision=0.5)  # the default backstop: 1


def test_plain_async_and_sync_april_cut_nothing_in_flight() -> None:
    for config in ({"max_staleness": 1}, {"max_staleness": 0, "over_provision": 1.0}):
        buf = buffer(groups_per_step=1, num_samples_per_prompt=1, **config)
        handed_out(buf, 3)
        assert buf.set_version(9) == [] and buf.cancelled == []


def test_remaining_tokens_never_goes_negative() -> None:
    assert april.remaining_tokens(0, 8) == 8
    assert april.remaining_tokens(3, 8) == 5
    assert april.remaining_tokens(8, 8) == 0
    assert april.remaining_tokens(9, 8) == 0


@pytest.mark.parametrize("mask", [True, False])
def test_resumed_tokens_are_masked_when_asked_and_resumed_groups_are_counted_when_trained(
    mask: bool,
) -> None:
    buf = buffer(
        groups_per_step=1, num_samples_per_prompt=2, over_provision=1.0, mask_resumed_tokens=mask
    )
    # B = 1, eta = 1, alpha = 1: (1 + 0 + 1) * 1 + 1 = 3 groups at v = 0.
    a, b, c = handed_out(buf, 3)
    assert buf.put(aborted_group(a, versions=[0, 0], aborted=[0], finished_versions=[0])) == (
        "partial"
    )
    assert buf.put(finished_group(b)) == "stored"
    assert buf.take_batch() is not None
    buf.set_version(1)
    (resumed,) = handed_out(buf, 1)
    assert resumed.group_uid == "p0"
    # Sample 0 continues with one token at v = 1; sample 1 finished before the abort.
    done = finished_group(resumed, versions=[1])
    assert buf.put(done) == "stored"
    batch = buf.take_batch()
    assert batch is not None
    (group,) = batch.groups
    masks = [s.loss_mask.tolist() for s in group.samples]
    stats = buf.statistics()
    if mask:
        # Every token sampled at v = 0, before the resume at v = 1: 2 + 1 of them.
        assert masks == [[0, 0, 1], [0]]
        assert stats.masked_tokens == 3
    else:
        assert masks == [[1, 1, 1], [1]]
        assert stats.masked_tokens == 0
    assert stats.resumed_consumed == 1
    assert c.group_uid in buf.in_flight


def test_mask_resumed_tokens_counts_only_tokens_that_were_trainable() -> None:
    sample = Sample(uid="g/0", group_id="g")
    sample.append_response([1, 2], [0.0, 0.0], 0)
    sample.append_response([3], [0.0], 0, loss_mask=0, role="tool")  # tool output
    sample.append_response([4, 5], [0.0, 0.0], [1, 2])
    group = Group(uid="g", prompt_uid="g", samples=[sample])
    assert april.mask_resumed_tokens(group, resumed_at_version=2) == 3  # 1, 2 and 4
    assert sample.loss_mask.tolist() == [0, 0, 0, 0, 1]


def test_the_partial_pool_serves_the_oldest_head_first_even_after_a_late_result() -> None:
    prompt = make_prompts(1)[0]

    def item(uid: str, version: int, head: int | None = None) -> WorkItem:
        work = WorkItem(group_uid=uid, prompt=prompt, num_samples=1, version=version)
        if head is None:
            return work
        partial = aborted_group(work, versions=[head])
        return msgspec.structs.replace(work, partial=partial)

    pool = april.PartialPool()
    pool.add(item("a", version=1))  # requeued before it produced anything: head 1
    pool.add(item("b", version=2, head=2))
    # A late partial result of "a" arrives with tokens from v = 3: it now waits at head 3,
    # behind "b", although it was queued first.
    pool.remove("a")
    pool.add(item("a", version=1, head=3))
    assert [i.group_uid for i in pool] == ["b", "a"]
    assert [pool.pop().group_uid, pool.pop().group_uid] == ["b", "a"]
    assert pool.pop() is None and len(pool) == 0


# -- requeue and duplicates ------------------------------------------------------------------
def test_requeued_work_is_handed_out_again_and_only_the_first_result_counts() -> None:
    buf = buffer(groups_per_step=1, num_samples_per_prompt=2)
    first, other = handed_out(buf, 2)
    assert buf.requeue([first.group_uid, "never-admitted"]) == 1
    assert buf.requeue([first.group_uid]) == 0  # not in flight any more
    stats = buf.statistics()
    assert (stats.ledger.in_flight, stats.ledger.partial) == (1, 1)
    (second,) = handed_out(buf, 1)
    assert (second.group_uid, second.attempt, second.partial) == (first.group_uid, 2, None)
    # The producer was not dead after all: its late result is accepted, once.
    assert buf.put(finished_group(first)) == "stored"
    assert buf.put(finished_group(second)) == "duplicate"
    assert buf.put(finished_group(first)) == "duplicate"
    stats = buf.statistics()
    assert (stats.duplicates, stats.ledger.buffered, stats.ledger.in_flight) == (2, 1, 1)
    assert buf.in_flight == [other.group_uid]
    buf.ledger.check()


def test_a_result_for_an_unknown_group_is_a_duplicate_not_an_error() -> None:
    buf = buffer()
    stranger = WorkItem(group_uid="x", prompt=make_prompts(1)[0], num_samples=4, version=0)
    assert buf.put(finished_group(stranger)) == "duplicate"
    assert buf.statistics().ledger.admitted == 0


# -- failures and filters --------------------------------------------------------------------
def test_a_failed_sample_fails_its_group_with_the_sample_error_and_frees_the_slot() -> None:
    buf = buffer(groups_per_step=1, num_samples_per_prompt=2, max_staleness=0)
    (a,) = handed_out(buf, 5)  # eta = 0, B = 1: one at a time
    assert buf.capacity() == 0
    assert buf.put(failed_group(a, "reward timed out after 30 s", index=1)) == "failed"
    assert buf.capacity() == 1  # a failed group gives its slot back
    (b,) = handed_out(buf, 5)
    assert buf.put(failed_group(b, None)) == "failed"
    assert buf.statistics().ledger.failed == {
        "reward timed out after 30 s": 1,
        "failed without a reason": 1,
    }
    buf.ledger.check()


def test_a_group_with_missing_samples_fails_instead_of_reaching_the_trainer() -> None:
    buf = buffer(groups_per_step=1, num_samples_per_prompt=2, max_staleness=2)
    a, b, c = handed_out(buf, 3)
    short = finished_group(a)
    short.samples = short.samples[:1]
    assert buf.put(short) == "failed"
    empty = finished_group(b)
    empty.samples = []
    assert buf.put(empty) == "failed"  # no head version: must not raise half-way through
    partial = aborted_group(c)
    partial.samples = partial.samples[1:]
    assert buf.put(partial) == "failed"  # nothing to resume the missing sample from
    assert buf.statistics().ledger.failed == {
        "expected 2 samples, got 1": 2,
        "expected 2 samples, got 0": 1,
    }
    assert (buf.in_flight, buf.take_batch()) == ([], None)
    buf.ledger.check()


def test_a_resumed_group_that_fails_or_is_filtered_leaves_no_resume_record() -> None:
    buf = buffer(groups_per_step=1, num_samples_per_prompt=2, filters=["zero_reward_variance"])
    a, b = handed_out(buf, 2)
    assert buf.put(aborted_group(a, versions=[0])) == "partial"
    assert buf.put(aborted_group(b, versions=[0])) == "partial"
    ra, rb = handed_out(buf, 2)
    assert buf.state_dict().resumed_at == {"p0": 0, "p1": 0}
    assert buf.put(failed_group(ra, "tool crashed")) == "failed"
    assert buf.put(finished_group(rb, rewards=[1.0, 1.0])) == "filtered"
    # Ended groups must not linger in the checkpointed resume records (a days-long run).
    assert buf.state_dict().resumed_at == {}
    assert buf.statistics().ledger.filtered == {"zero_reward_variance": 1}


# -- staleness ------------------------------------------------------------------------------
def test_consumed_samples_and_tokens_are_counted_by_staleness() -> None:
    buf = buffer(groups_per_step=1, num_samples_per_prompt=2, max_staleness=2)
    (a,) = handed_out(buf, 1)
    buf.set_version(1)
    # Sample 0 started at v = 0 and continued at v = 1; sample 1 ran entirely at v = 1.
    assert buf.put(finished_group(a, versions=[[0, 1], [1, 1, 1]])) == "stored"
    buf.set_version(2)
    assert buf.take_batch() is not None
    stats = buf.statistics()
    # Head staleness at v = 2: 2 - 0 = 2 and 2 - 1 = 1.
    assert stats.staleness_samples == {2: 1, 1: 1}
    # Per token: one token of lag 2, four of lag 1.
    assert stats.staleness_tokens == {2: 1, 1: 4}


def test_the_backstop_drops_groups_staler_than_hard_staleness_as_stale() -> None:
    # eta = 1, so hard_staleness defaults to 2.
    buf = buffer(groups_per_step=1, num_samples_per_prompt=1, max_staleness=1)
    assert buf.config.resolved_hard_staleness == 2
    a, b = handed_out(buf, 2)
    assert buf.put(finished_group(a, versions=[0])) == "stored"
    buf.set_version(2)
    assert buf.put(finished_group(b, versions=[0])) == "stored"
    batch = buf.take_batch()  # staleness 2: still allowed
    assert batch is not None and batch.groups[0].uid == "p0"
    buf.set_version(3)
    assert not buf.ready()  # staleness 3 > 2: dropped
    assert buf.take_batch() is None
    stats = buf.statistics()
    c = stats.ledger
    assert (c.filtered, c.buffered, c.consumed) == ({"stale": 1}, 0, 1)
    buf.ledger.check()


# -- checkpoints ----------------------------------------------------------------------------
def write_prompts(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "label": i}) + "\n" for i in range(n)))
    return path


def test_a_checkpoint_through_the_codec_continues_with_no_prompt_lost_or_repeated(
    tmp_path: Path,
) -> None:
    path = write_prompts(tmp_path / "train.jsonl", 10)
    source_cfg = PromptSource.Config(path=str(path), seed=3)
    cfg = VersionedBuffer.Config(groups_per_step=2, num_samples_per_prompt=2, over_provision=0.5)
    buf = VersionedBuffer(cfg, PromptSource.open(source_cfg))
    # v = 0: (1 + 0 + 1) * 2 + 1 = 5 groups.
    items = handed_out(buf, 10)
    assert len(items) == 5
    buf.put(finished_group(items[0]))
    buf.put(finished_group(items[1]))
    assert buf.put(aborted_group(items[2], versions=[0])) == "partial"
    batch = buf.take_batch()
    assert batch is not None
    consumed = [g.prompt_uid for g in batch.groups]
    buf.set_version(1)
    assert handed_out(buf, 1)[0].group_uid == items[2].group_uid  # resumed, then checkpoint

    full_before = buf.statistics()
    before = full_before.ledger
    restored = VersionedBuffer(cfg, PromptSource.open(source_cfg))
    restored.load_state_dict(through_codec(buf.state_dict()))
    full_after = restored.statistics()
    after = full_after.ledger
    # The three groups in flight at the checkpoint now wait to be resumed.
    assert ((before.in_flight, before.partial), (after.in_flight, after.partial)) == (
        (3, 0),
        (0, 3),
    )
    assert (after.admitted, after.consumed, after.buffered) == (5, 2, 0)
    assert (full_after.version, full_after.batches, full_after.capacity) == (
        1, 1, full_before.capacity,
    )  # fmt: skip
    # A producer that outlived the old buffer delivers: accepted once.
    assert restored.put(finished_group(items[3])) == "stored"
    assert restored.put(finished_group(items[3])) == "duplicate"

    for _ in range(20):  # 10 prompts, B = 2: five batches; a bug must not hang the test
        if restored.exhausted:
            break
        for item in handed_out(restored, 10):
            assert restored.put(finished_group(item, versions=[restored.version])) == "stored"
        while (batch := restored.take_batch()) is not None:
            consumed += [g.prompt_uid for g in batch.groups]
            restored.set_version(restored.version + 1)
    everything = [p.uid for p in PromptSource.open(source_cfg).take(100)]
    assert len(everything) == 10
    assert sorted(consumed) == sorted(everything)
    stats = restored.statistics()
    assert (stats.ledger.consumed, stats.ledger.filtered, stats.ledger.failed) == (10, {}, {})
    restored.ledger.check()


def test_load_state_dict_needs_a_fresh_buffer() -> None:
    buf = buffer()
    handed_out(buf, 1)
    with pytest.raises(RuntimeError, match="fresh buffer"):
        buf.load_state_dict(buf.state_dict())


# -- property test ----------------------------------------------------------------------------
NUM_PROMPTS = 14  # in the source
NUM_EXTRA = 6  # offered from outside the source (eval sets)


@st.composite
def configs(draw: st.DrawFn) -> VersionedBuffer.Config:
    eta = draw(st.integers(0, 3))
    alpha = draw(st.sampled_from([0.0, 0.5, 1.0]))
    lowest_hard = max(eta, 1) if alpha else eta  # APRIL's partials land a version old
    return VersionedBuffer.Config(
        groups_per_step=draw(st.integers(1, 4)),
        num_samples_per_prompt=draw(st.integers(1, 3)),
        max_staleness=eta,
        hard_staleness=draw(st.none() | st.integers(lowest_hard, eta + 2)),
        age_guarantee=draw(st.none() | st.integers(0, 3)),
        over_provision=alpha,
        max_in_flight=draw(st.none() | st.integers(1, 6)),
        priority=draw(st.sampled_from(sorted(PRIORITIES))),
        max_reuse=draw(st.integers(1, 2)),
        filters=draw(st.sampled_from([[], ["zero_reward_variance"]])),
        mask_resumed_tokens=draw(st.booleans()),
    )


# Weighted so that a typical run admits, finishes and consumes several steps' worth of work,
# while every disruption (abort, failure, duplicate, requeue, restore) still shows up often.
OPERATION_NAMES = [
    *["admit"] * 4,
    *["finish"] * 5,
    *["abort", "fail", "short", "duplicate", "requeue", "restore", "offer"],
    *["bump"] * 2,
    *["consume"] * 3,
]
OPERATIONS = st.lists(
    st.tuples(st.sampled_from(OPERATION_NAMES), st.integers(0, 15), st.integers(0, 2**16)),
    min_size=30,
    max_size=40,
)


class Simulation:
    """Producers and a trainer around one buffer, with a model of where each prompt is.

    ``where`` maps each admitted prompt uid to in_flight / pool / buffered / consumed /
    filtered / failed, updated from what the test did and predicted independently of the
    buffer's own bookkeeping; ``check`` compares the two.
    """

    def __init__(self, cfg: VersionedBuffer.Config) -> None:
        self.cfg = cfg
        self.prompts = make_prompts(NUM_PROMPTS)
        self.extra = make_prompts(NUM_EXTRA, prefix="e")
        self.buf = VersionedBuffer(cfg, ListSource(self.prompts))
        self.from_source = 0  # prompts the buffer drew from its source
        self.waiting: list[str] = []  # offered and not admitted yet, in order
        self.offered = 0
        self.where: dict[str, str] = {}
        self.served: Counter[str] = Counter()
        self.outstanding: list[WorkItem] = []  # held by producers, alive or presumed dead
        self.items: dict[str, WorkItem] = {}  # each group's work as the buffer holds it
        self.cancelled: set[str] = set()  # cut in flight by asynchronous APRIL, not back yet
        self.delivered: list[Group] = []
        self.consumed_this_version = False

    @property
    def hard(self) -> int:
        return self.cfg.resolved_hard_staleness

    @property
    def age_guarantee(self) -> int:
        ag = self.cfg.age_guarantee
        return self.cfg.max_staleness if ag is None else ag

    def uids_in(self, state: str) -> set[str]:
        return {uid for uid, s in self.where.items() if s == state}

    # -- producers --------------------------------------------------------------------------
    def admit(self, arg: int, seed: int) -> None:
        k = arg % 4
        cfg, buf = self.cfg, self.buf
        pool, in_flight = len(self.uids_in("pool")), len(self.uids_in("in_flight"))
        cap = cfg.max_in_flight
        resumes = min(k, pool, k if cap is None else max(cap - in_flight, 0))
        # Synchronous APRIL: once a step's groups are buffered, its aborted extras and any
        # new group wait for the next version.
        step_done = len(self.uids_in("buffered")) >= cfg.groups_per_step
        sync_step_done = cfg.max_staleness == 0 and cfg.over_provision > 0 and step_done
        if sync_step_done:
            resumes = 0
        # Rule (1) on the model's own counts: live groups plus every group ever consumed.
        holding = sum(s in ("in_flight", "pool", "buffered") for s in self.where.values())
        holding += len(self.served)
        room = admission_limit(
            version=buf.version,
            max_staleness=cfg.max_staleness,
            groups_per_step=cfg.groups_per_step,
            over_provision=cfg.over_provision,
        )
        room -= holding
        if cap is not None:
            room = min(room, cap - in_flight - resumes)
        if sync_step_done:
            room = 0
        queued = self.waiting + [p.uid for p in self.prompts[self.from_source :]]
        fresh = max(0, min(k - resumes, room, len(queued)))
        items = [over_the_wire(i) for i in buf.next_work(k)]
        assert len(items) == resumes + fresh
        for item in items[:resumes]:
            assert self.where[item.group_uid] == "pool" and item.attempt >= 2
            assert item.version == buf.version
        # Offered prompts first, in order, then the source's, in order: none skipped.
        assert [i.group_uid for i in items[resumes:]] == queued[:fresh]
        from_waiting = min(fresh, len(self.waiting))
        self.waiting = self.waiting[from_waiting:]
        self.from_source += fresh - from_waiting
        assert all(i.attempt == 1 and i.partial is None for i in items[resumes:])
        for item in items:
            assert item.num_samples == cfg.num_samples_per_prompt
            self.where[item.group_uid] = "in_flight"
            self.items[item.group_uid] = item
        self.outstanding += items

    def offer(self, arg: int, seed: int) -> None:
        prompts = self.extra[self.offered : self.offered + arg % 3 + 1]
        self.buf.offer([over_the_wire(p) for p in prompts])
        self.offered += len(prompts)
        self.waiting += [p.uid for p in prompts]

    def new_versions(self, item: WorkItem, rng: random.Random, low: int = 1) -> list[int]:
        """1 or 2 tokens, sampled between the item's hand-out and now, in order."""
        versions = [rng.randint(item.version, self.buf.version) for _ in range(rng.randint(low, 2))]
        return sorted(versions)

    def finish(self, index: int, seed: int) -> None:
        if not self.outstanding:
            return
        rng = random.Random(seed)
        item = self.outstanding.pop(index % len(self.outstanding))
        n = item.num_samples
        versions = [self.new_versions(item, rng) for _ in range(n)]
        group = finished_group(item, versions=versions, rewards=[rng.choice([0.0, 1.0])] * n)
        for sample in group.samples:  # rewards are drawn per sample; resumed ones keep theirs
            if sample.status is SampleStatus.COMPLETED and sample.finish_reason == "stop":
                sample.reward = rng.choice([0.0, 1.0])
        self.deliver(group)

    def abort(self, index: int, seed: int) -> None:
        if not self.outstanding:
            return
        rng = random.Random(seed)
        item = self.outstanding.pop(index % len(self.outstanding))
        undone = [s.index for s in start_samples(item) if not s.is_done]
        cut = rng.sample(undone, rng.randint(1, len(undone)))
        versions = self.new_versions(item, rng, low=0)
        finished = self.new_versions(item, rng)
        group = aborted_group(item, versions=versions, aborted=cut, finished_versions=finished)
        self.deliver(group)

    def fail(self, index: int, seed: int) -> None:
        if self.outstanding:
            item = self.outstanding.pop(index % len(self.outstanding))
            self.deliver(failed_group(item, "tool crashed", index=0))

    def short(self, index: int, seed: int) -> None:
        """A producer bug: a finished group with its last samples missing."""
        if self.outstanding:
            item = self.outstanding.pop(index % len(self.outstanding))
            group = finished_group(item)
            group.samples = group.samples[: seed % item.num_samples]
            self.deliver(group)

    def duplicate(self, index: int, seed: int) -> None:
        if self.delivered:
            self.deliver(self.delivered[index % len(self.delivered)])

    def deliver(self, group: Group) -> None:
        expected = self.predict(group)
        self.delivered.append(group)
        assert self.buf.put(over_the_wire(group)) == expected
        if expected == "partial":
            self.items[group.uid] = msgspec.structs.replace(self.items[group.uid], partial=group)
        if expected not in ("duplicate", "cancelled"):
            state = {"stored": "buffered", "partial": "pool"}.get(expected, expected)
            self.where[group.uid] = state

    def predict(self, group: Group) -> str:
        if group.uid in self.cancelled:  # the first result after the cut
            self.cancelled.discard(group.uid)
            return "cancelled"
        if self.where.get(group.uid) not in ("in_flight", "pool"):
            return "duplicate"
        if len(group.samples) != self.cfg.num_samples_per_prompt:
            return "failed"
        statuses = {s.status for s in group.samples}
        if statuses & {SampleStatus.PENDING, SampleStatus.ABORTED}:
            return "partial"
        if SampleStatus.FAILED in statuses:
            return "failed"
        rewards = [s.reward for s in group.samples]
        if self.cfg.filters and len(rewards) > 1 and len(set(rewards)) == 1:
            return "filtered"
        if self.buf.version - group.head_version > self.hard:
            return "filtered"  # past the backstop on arrival: dropped at once
        return "stored"

    def requeue(self, mask: int, seed: int) -> None:
        flying = sorted(self.buf.in_flight)
        dead = [uid for bit, uid in enumerate(flying) if mask >> bit & 1]
        assert self.buf.requeue([*dead, "not-a-group"]) == len(dead)
        for uid in dead:  # their items stay with "dead" producers, who may still deliver
            self.where[uid] = "pool"

    # -- trainer ----------------------------------------------------------------------------
    def bump(self, arg: int, seed: int) -> None:
        # The trainer steps after consuming a batch; now and then it steps anyway (a batch
        # that came from elsewhere, an eval step), which ages the buffered work. Now and
        # then it jumps past the backstop (announcements conflated while work still runs).
        if self.consumed_this_version or arg % 4 == 0:
            v = self.buf.version + (1 + self.hard if arg % 8 == 4 else 1)
            stale = [
                e.group.uid for e in self.buf.store.entries() if v - e.head_version > self.hard
            ]
            doomed = self.doomed(v)
            cut = sorted(u for u in doomed if self.where[u] == "in_flight")
            assert self.buf.set_version(v) == cut
            for uid in stale:  # dropped by the backstop at once, not at the next take
                if self.where[uid] == "buffered":  # a reused group was consumed already
                    self.where[uid] = "filtered"
            for uid in doomed:
                if self.where[uid] == "in_flight":
                    self.cancelled.add(uid)
                self.where[uid] = "filtered"
            self.consumed_this_version = False

    def doomed(self, v: int) -> list[str]:
        """Asynchronous APRIL cuts work that can only end past the backstop at ``v``: in
        flight or waiting, handed out at a head older than ``v - hard``."""
        if self.cfg.over_provision == 0 or self.cfg.max_staleness == 0:
            return []
        live = [u for u, s in self.where.items() if s in ("in_flight", "pool")]
        return [u for u in live if april.head_version(self.items[u]) < v - self.hard]

    def consume(self, arg: int = 0, seed: int = 0) -> bool:
        """The trainer asks for a batch; True if it got one."""
        buf, v = self.buf, self.buf.version
        stored = buf.store.entries()
        alive = [e for e in stored if v - e.head_version <= self.hard]
        evicted = [e.group.uid for e in stored if v - e.head_version > self.hard]
        batch = buf.take_batch()
        for uid in evicted:
            if self.where[uid] == "buffered":  # a reused group was consumed already
                self.where[uid] = "filtered"
        # At the end of the data (nothing left to admit, generate or resume) the last,
        # shorter batch is served too, so no finished group is stranded.
        queued = self.waiting or self.from_source < NUM_PROMPTS
        draining = not (queued or self.uids_in("in_flight") or self.uids_in("pool"))
        size = min(self.cfg.groups_per_step, len(alive))
        if size < self.cfg.groups_per_step and not (size and draining):
            assert batch is None
            return False
        assert batch is not None and batch.step == v
        taken = [g.uid for g in batch.groups]
        assert len(taken) == size == len(set(taken))
        for group in batch.groups:
            self.check_trainable(group, v)
            self.served[group.uid] += 1
            assert self.served[group.uid] <= self.cfg.max_reuse
            assert self.where[group.uid] in ("buffered", "consumed")
            self.where[group.uid] = "consumed"
        self.check_serving_order(alive, set(taken), v)
        self.consumed_this_version = True
        return True

    def check_trainable(self, group: Group, version: int) -> None:
        assert group.prompt_uid == group.uid
        assert len(group.samples) == self.cfg.num_samples_per_prompt
        assert [s.index for s in group.samples] == list(range(len(group.samples)))
        for sample in group.samples:
            assert sample.status is SampleStatus.COMPLETED
            assert sample.group_id == group.uid
            assert 0 <= sample.staleness(version) <= self.hard

    def check_serving_order(self, alive: list, taken: set[str], version: int) -> None:
        """Urgent groups (staleness >= age guarantee) first, oldest first; then priority."""
        priority = PRIORITIES[self.cfg.priority]
        chosen = [e for e in alive if e.group.uid in taken]
        passed = [e for e in alive if e.group.uid not in taken]
        for left in passed:
            staleness = version - left.head_version
            if staleness >= self.age_guarantee:
                assert all(version - e.head_version >= staleness for e in chosen)
            else:
                fresh = [e for e in chosen if version - e.head_version < self.age_guarantee]
                assert all(priority(e.group) >= priority(left.group) for e in fresh)

    # -- checkpoints --------------------------------------------------------------------------
    def restore(self, arg: int = 0, seed: int = 0) -> None:
        before = self.buf.statistics()
        restored = VersionedBuffer(self.cfg, ListSource(self.prompts))
        restored.load_state_dict(through_codec(self.buf.state_dict()))
        after = restored.statistics()
        assert after.ledger.in_flight == 0
        assert after.ledger.partial == before.ledger.partial + before.ledger.in_flight
        same = ("admitted", "buffered", "consumed", "filtered", "failed")
        assert [getattr(after.ledger, f) for f in same] == [getattr(before.ledger, f) for f in same]
        assert (after.version, after.batches) == (before.version, before.batches)
        if self.cfg.max_in_flight is None:  # with a cap, restored work no longer fills it
            assert after.capacity == before.capacity
        for uid in self.uids_in("in_flight"):
            self.where[uid] = "pool"
        self.buf = restored

    # -- invariants -------------------------------------------------------------------------
    def check(self) -> None:
        buf = self.buf
        buf.ledger.check()
        pending = [p.uid for p in buf.state_dict().pending]
        assert pending == self.waiting
        in_store = [e.group.uid for e in buf.store.entries()]
        places = [*pending, *buf.in_flight, *(i.group_uid for i in buf.pool)]
        places += [uid for uid in in_store if uid not in self.served]  # reused ones are consumed
        ended = [uid for uid, s in self.where.items() if s in ("consumed", "filtered", "failed")]
        # Every drawn prompt in exactly one place.
        drawn = [p.uid for p in self.prompts[: self.from_source] + self.extra[: self.offered]]
        assert sorted(places + ended) == sorted(drawn)
        assert set(buf.in_flight) == self.uids_in("in_flight")
        assert {i.group_uid for i in buf.pool} == self.uids_in("pool")
        assert set(in_store) - set(self.served) == self.uids_in("buffered")
        assert set(in_store) <= self.uids_in("buffered") | self.uids_in("consumed")
        c = buf.ledger.counts()
        assert (c.admitted, c.consumed) == (len(self.where), len(self.uids_in("consumed")))
        assert sum(c.filtered.values()) == len(self.uids_in("filtered"))
        assert sum(c.failed.values()) == len(self.uids_in("failed"))
        live = self.uids_in("in_flight") | self.uids_in("pool") | self.uids_in("buffered")
        source_done = self.from_source == NUM_PROMPTS
        assert buf.exhausted == (source_done and not self.waiting and not live)
        # Synchronous APRIL aborts once a step's worth of new groups finished while others
        # still run; asynchronous APRIL never aborts for a step.
        enough = len(self.uids_in("buffered")) >= self.cfg.groups_per_step
        flying = bool(self.uids_in("in_flight"))
        sync_april = self.cfg.over_provision > 0 and self.cfg.max_staleness == 0
        assert buf.should_abort() == (sync_april and enough and flying)
        assert set(buf.cancelled) == self.cancelled


def run_operation(sim: Simulation, op: tuple[str, int, int]) -> None:
    name, arg, seed = op
    getattr(sim, name)(arg, seed)


@settings(
    max_examples=500,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cfg=configs(), operations=OPERATIONS)
def test_random_interleavings_lose_nothing_repeat_nothing_and_respect_staleness(
    cfg: VersionedBuffer.Config, operations: list[tuple[str, int, int]]
) -> None:
    sim = Simulation(cfg)
    for op in operations:
        run_operation(sim, op)
        sim.check()
    # Run to the end of the data with producers that always finish and a trainer that steps
    # after each batch (or when stuck): every prompt must end consumed, filtered or failed.
    for _ in range(200):
        if sim.buf.exhausted and not len(sim.buf.store):
            break
        sim.admit(3, 0)
        while sim.outstanding:
            sim.finish(0, len(sim.outstanding))
        sim.consume()
        sim.bump(0, 0)  # arg 0 steps even without a batch, which unsticks admission
        sim.check()
    assert sim.buf.exhausted and not len(sim.buf.store)
    assert sim.from_source == NUM_PROMPTS and not sim.waiting
    assert set(sim.where.values()) <= {"consumed", "filtered", "failed"}
