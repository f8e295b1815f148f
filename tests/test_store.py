"""The versioned priority store and the dynamic-sampling filters.

Priorities, the age guarantee, the staleness backstop, bounded reuse, broken user code
(priorities and filters) and the lazy-deletion heaps under churn.
"""

from __future__ import annotations

import pytest

from asyncrl.buffer.filters import (
    FilterFailed,
    apply_filters,
    load_filter,
    zero_reward_variance,
)
from asyncrl.buffer.store import VersionedStore, load_priority, oldest
from asyncrl.buffer.versioned import VersionedBuffer
from asyncrl.types import Group, Sample, SampleStatus
from tests.buffer_sim import finished_group, make_prompts

NOT_CALLABLE = 42


def by_length(group: Group) -> float:
    """Custom priority (loaded by dotted path): groups with more response tokens first."""
    return group.num_tokens


def picky(group: Group) -> float:
    """Custom priority that raises for groups whose uid ends in ``"!"``."""
    if group.uid.endswith("!"):
        raise RuntimeError("cannot score this one")
    return 0.0


def too_short(group: Group) -> str | None:
    """Custom filter (loaded by dotted path): drop groups with fewer than 3 tokens."""
    return "too_short" if group.num_tokens < 3 else None


def exploding(group: Group) -> str | None:
    """Custom filter that always raises."""
    raise RuntimeError("reward model unreachable")


def group(
    uid: str,
    head: int,
    *,
    rewards: tuple[float | None, ...] = (0.0, 1.0),
    tokens: int = 1,
) -> Group:
    """A finished group whose tokens were all sampled at version ``head``."""
    samples = []
    for i, reward in enumerate(rewards):
        sample = Sample(uid=f"{uid}/{i}", group_id=uid, index=i, admitted_at_version=head)
        sample.append_response(list(range(tokens)), [0.0] * tokens, head)
        sample.status, sample.reward = SampleStatus.COMPLETED, reward
        samples.append(sample)
    return Group(uid=uid, prompt_uid=uid, samples=samples)


def store(priority: str = "oldest", **kw: int) -> VersionedStore:
    """A store where nothing is urgent or stale unless the test says so."""
    args = {"hard_staleness": 100, "age_guarantee": 100, **kw}
    return VersionedStore(priority=load_priority(priority), **args)


def uids(s: VersionedStore, n: int, version: int) -> list[str]:
    return [e.group.uid for e in s.take(n, version).groups]


# -- priorities ----------------------------------------------------------------------------
def test_oldest_serves_the_lowest_head_version_first_ties_in_arrival_order() -> None:
    s = store("oldest")
    for uid, head in [("c", 3), ("a", 1), ("b1", 2), ("b2", 2)]:
        s.put(group(uid, head))
    assert uids(s, 4, version=3) == ["a", "b1", "b2", "c"]
    assert s.priority is oldest


def test_freshness_serves_the_newest_head_version_first() -> None:
    s = store("freshness")
    for uid, head in [("b", 2), ("a", 1), ("c", 3)]:
        s.put(group(uid, head))
    assert uids(s, 2, version=3) == ["c", "b"]
    assert uids(s, 1, version=3) == ["a"]


def test_reward_variance_serves_the_most_informative_group_first_ignoring_missing_rewards() -> None:
    s = store("reward_variance")
    s.put(group("flat", 0, rewards=(1.0, 1.0)))  # var 0
    s.put(group("split", 0, rewards=(0.0, 1.0)))  # var 0.25
    s.put(group("half", 0, rewards=(0.0, 0.5)))  # var 0.0625
    # A missing reward is ignored, not a NaN that would sort anywhere: (0, 1) -> var 0.25,
    # tied with "split" and behind it in arrival order.
    s.put(group("partial", 0, rewards=(0.0, None, 1.0)))
    s.put(group("none", 0, rewards=(None, None)))  # nothing to score: 0
    assert uids(s, 5, version=0) == ["split", "partial", "half", "flat", "none"]


def test_a_custom_priority_is_loaded_by_dotted_path() -> None:
    s = store("tests.test_store:by_length")
    assert s.priority is by_length
    s.put(group("short", 0, tokens=1))
    s.put(group("long", 0, tokens=3))
    s.put(group("mid", 0, tokens=2))
    assert uids(s, 3, version=0) == ["long", "mid", "short"]


def test_a_priority_path_that_is_not_a_callable_is_refused() -> None:
    with pytest.raises(ValueError, match="not callable"):
        load_priority("tests.test_store:NOT_CALLABLE")
    with pytest.raises(ValueError, match="has no"):
        load_priority("tests.test_store:no_such_priority")


def test_a_raising_priority_keeps_the_group_and_counts_the_error() -> None:
    s = store("tests.test_store:picky")
    s.put(group("ok", 0))
    s.put(group("bad!", 0))
    assert s.priority_errors == 1
    assert len(s) == 2
    assert sorted(uids(s, 2, version=0)) == ["bad!", "ok"]


# -- age guarantee and backstop ---------------------------------------------------------------
def test_the_age_guarantee_beats_any_priority() -> None:
    # Freshness wants head 5 first; at v = 5 with age_guarantee 2, heads 3 and 2 are
    # urgent (staleness 2 and 3), so they go first, oldest first.
    s = store("freshness", age_guarantee=2)
    for uid, head in [("h5", 5), ("h3", 3), ("h4", 4), ("h2", 2)]:
        s.put(group(uid, head))
    assert uids(s, 1, version=5) == ["h2"]
    assert uids(s, 3, version=5) == ["h3", "h5", "h4"]


def test_the_age_guarantee_beats_reward_variance() -> None:
    s = store("reward_variance", age_guarantee=1)
    s.put(group("informative", 3, rewards=(0.0, 1.0)))
    s.put(group("flat_but_old", 2, rewards=(1.0, 1.0)))
    assert uids(s, 1, version=3) == ["flat_but_old"]


def test_the_backstop_evicts_groups_staler_than_hard_staleness() -> None:
    s = store("freshness", hard_staleness=1)
    for uid, head in [("h1", 1), ("h2", 2), ("h3", 3)]:
        s.put(group(uid, head))
    # v = 3: h1 has staleness 2 > 1, evicted and returned; h2 (1) and h3 (0) stay servable.
    taken = s.take(3, version=3)
    assert [e.group.uid for e in taken.evicted] == ["h1"]
    assert [e.group.uid for e in taken.groups] == ["h3", "h2"]
    assert len(s) == 0


def test_evict_stale_removes_only_what_is_past_the_backstop() -> None:
    s = store(hard_staleness=2)
    for uid, head in [("h0", 0), ("h1", 1), ("h2", 2)]:
        s.put(group(uid, head))
    assert [e.group.uid for e in s.evict_stale(3)] == ["h0"]
    assert [e.group.uid for e in s.evict_stale(4)] == ["h1"]
    assert [e.group.uid for e in s.entries()] == ["h2"]


def test_the_store_refuses_a_group_twice_and_bad_settings() -> None:
    s = store()
    s.put(group("a", 0))
    with pytest.raises(ValueError, match="already stored"):
        s.put(group("a", 0))
    for bad in ({"max_reuse": 0}, {"hard_staleness": -1}, {"age_guarantee": -1}):
        with pytest.raises(ValueError, match="need max_reuse"):
            VersionedStore(**{"hard_staleness": 1, "age_guarantee": 1, **bad})


# -- reuse --------------------------------------------------------------------------------
def test_bounded_reuse_serves_a_group_at_most_max_reuse_times_never_twice_in_a_batch() -> None:
    s = store("oldest", max_reuse=2)
    for uid in "abc":
        s.put(group(uid, 0))
    batches = []
    while len(s):
        batches.append(uids(s, 2, version=0))
    served = [u for b in batches for u in b]
    assert all(len(set(b)) == len(b) for b in batches)
    assert sorted(served) == ["a", "a", "b", "b", "c", "c"]
    # Oldest first with reused groups behind fresh arrivals of the same version.
    assert batches == [["a", "b"], ["c", "a"], ["b", "c"]]


def test_a_reused_group_still_meets_the_backstop() -> None:
    s = store("oldest", max_reuse=3, hard_staleness=1)
    s.put(group("a", 0))
    assert uids(s, 1, version=0) == ["a"]
    assert uids(s, 1, version=1) == ["a"]
    taken = s.take(1, version=2)  # staleness 2 > 1: evicted though served only twice
    assert ([e.group.uid for e in taken.evicted], taken.groups) == (["a"], [])


# -- lazy deletion ------------------------------------------------------------------------
def test_compaction_keeps_the_heaps_bounded_under_churn() -> None:
    # One old group stays at the top of the age heap forever (freshness never picks it and
    # it is never urgent), so the age heap's dead items are never popped: only compaction
    # removes them. The heap sizes are private, and they are exactly what this test is about.
    s = store("freshness", hard_staleness=10**6, age_guarantee=10**6)
    s.put(group("pinned", 0))
    for i in range(1, 3000):
        s.put(group(f"g{i}", i))
        # Checked after a put, where compaction runs: 2 live groups, so at most 4 * 2 + 64.
        assert len(s._by_age) + len(s._by_priority) <= 4 * len(s) + 64
        assert uids(s, 1, version=i) == [f"g{i}"]
    assert [e.group.uid for e in s.entries()] == ["pinned"]
    assert s.peak == 2


# -- filters ------------------------------------------------------------------------------
def test_zero_reward_variance_drops_only_groups_whose_rewards_all_agree() -> None:
    assert zero_reward_variance(group("same", 0, rewards=(1.0, 1.0, 1.0))) == "zero_reward_variance"
    assert zero_reward_variance(group("zeros", 0, rewards=(0.0, 0.0))) == "zero_reward_variance"
    assert zero_reward_variance(group("differ", 0, rewards=(1.0, 0.0))) is None
    # One sample has no reward: we cannot tell the variance, so keep it.
    assert zero_reward_variance(group("nan", 0, rewards=(1.0, None))) is None
    # One sample alone has no variance to speak of; dropping it would drop every n = 1 run.
    assert zero_reward_variance(group("single", 0, rewards=(1.0,))) is None


def test_zero_reward_variance_reads_the_score_of_dict_rewards() -> None:
    g = group("dict", 0)
    g.samples[0].reward = {"score": 1.0, "format": 0.0}
    g.samples[1].reward = {"score": 1.0, "format": 1.0}
    assert zero_reward_variance(g) == "zero_reward_variance"
    g.samples[1].reward = {"score": 0.5}
    assert zero_reward_variance(g) is None


def test_filters_load_by_name_or_dotted_path_and_the_first_reason_wins() -> None:
    assert load_filter("zero_reward_variance") is zero_reward_variance
    assert load_filter("tests.test_store:too_short") is too_short
    with pytest.raises(ValueError, match="not callable"):
        load_filter("tests.test_store:NOT_CALLABLE")
    filters = [("zero_reward_variance", zero_reward_variance), ("too_short", too_short)]
    assert apply_filters(group("g", 0, rewards=(1.0, 1.0)), filters) == "zero_reward_variance"
    assert apply_filters(group("g", 0, rewards=(0.0, 1.0)), filters) == "too_short"
    assert apply_filters(group("g", 0, rewards=(0.0, 1.0), tokens=2), filters) is None


def test_a_raising_filter_names_itself_in_the_error() -> None:
    with pytest.raises(FilterFailed, match="filter boom raised RuntimeError: reward model"):
        apply_filters(group("g", 0), [("boom", exploding)])


def test_a_custom_filter_drops_with_its_reason_and_a_raising_one_fails_the_group() -> None:
    cfg = VersionedBuffer.Config(
        groups_per_step=4,
        num_samples_per_prompt=2,
        filters=["zero_reward_variance", "tests.test_store:too_short"],
    )
    buf = VersionedBuffer(cfg)
    buf.offer(make_prompts(3))
    a, b, c = buf.next_work(3)
    assert buf.put(finished_group(a, versions=[0])) == "filtered"  # 2 tokens < 3
    assert buf.put(finished_group(b, versions=[0, 0])) == "stored"  # 4 tokens
    assert buf.put(finished_group(c, rewards=[1.0, 1.0])) == "filtered"
    assert buf.statistics().ledger.filtered == {"too_short": 1, "zero_reward_variance": 1}

    cfg = VersionedBuffer.Config(num_samples_per_prompt=2, filters=["tests.test_store:exploding"])
    buf = VersionedBuffer(cfg)
    buf.offer(make_prompts(1))
    (item,) = buf.next_work(1)
    assert buf.put(finished_group(item)) == "failed"
    reason = "filter tests.test_store:exploding raised RuntimeError: reward model unreachable"
    assert buf.statistics().ledger.failed == {reason: 1}
    buf.ledger.check()
