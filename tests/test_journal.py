"""The buffer's write-ahead journal and the hub it makes crash-safe.

A hub rebuilt from its last checkpoint plus its journal must equal the hub that died,
whatever producers and the trainer did in between (the property test plays them in
random order, with checkpoints at random points); a torn journal tail is the end, any
other damage names the file and the byte; a producer asking again gets the same work;
a restarted trainer is served every batch after its checkpoint again, in order.
"""

from __future__ import annotations

import json
import random
import re
import tempfile
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncrl.buffer.checkpoint import read_checkpoint, recover_hub, write_checkpoint
from asyncrl.buffer.hub import Hub, HubState, ReplayDiverged
from asyncrl.buffer.journal import Followed, Handed, Journal, Returned, read_journal
from asyncrl.buffer.versioned import VersionedBuffer
from asyncrl.errors import CheckpointUnreadable, RunStateLost
from asyncrl.types import Group, TrainBatch, WorkItem
from tests.buffer_sim import (
    ListSource,
    aborted_group,
    failed_group,
    finished_group,
    make_prompts,
    over_the_wire,
)
from tests.test_buffer import configs

NUM_PROMPTS = 24


def new_hub(cfg: VersionedBuffer.Config, journal: Path | None = None) -> Hub:
    """A hub over ``NUM_PROMPTS`` listed prompts, with a constant clock (so queue ages, the
    one input that is not in the journal, match between a hub and its replay)."""
    buf = VersionedBuffer(cfg, ListSource(make_prompts(NUM_PROMPTS)), clock=lambda: 0.0)
    return Hub(buf, Journal(journal) if journal else None)


def checkpoint(hub: Hub, path: Path) -> None:
    """What the actor does: commit, write the checkpoint, start the journal after it."""
    hub.commit()
    write_checkpoint(hub.state_dict(), path)
    assert hub.journal is not None
    hub.journal.reset(hub.lineage, hub.journal_seq + 1)


def comparable(state: HubState) -> HubState:
    """The state without the duplicate-delivery counter (duplicates change nothing, so
    they are not journaled: the counter restarts from the checkpoint's)."""
    tallies = json.loads(state.buffer.tallies)
    tallies.pop("duplicates")
    buffer = msgspec.structs.replace(state.buffer, tallies=json.dumps(tallies).encode())
    return msgspec.structs.replace(state, buffer=buffer)


# -- the file format -----------------------------------------------------------------------
def test_a_journal_reads_back_its_records_and_a_torn_tail_is_its_end(tmp_path: Path):
    journal = Journal(tmp_path / "j")
    journal.reset("line-a", 5)
    records = [Followed(version=v) for v in range(1, 4)]
    assert journal.append(records[:2]) == 6 and journal.append(records[2:]) == 7
    journal.close()
    header, rows = read_journal(tmp_path / "j")
    assert (header.lineage, header.first_seq) == ("line-a", 5)
    assert list(rows) == list(zip([5, 6, 7], records, strict=True))
    whole = (tmp_path / "j").read_bytes()
    for cut in (1, 5, 9):  # inside the last record's prefix or body: never acknowledged
        (tmp_path / "j").write_bytes(whole[:-cut])
        assert [seq for seq, _ in read_journal(tmp_path / "j")[1]] == [5, 6]


def test_a_damaged_journal_record_is_refused_naming_the_file_and_byte(tmp_path: Path):
    journal = Journal(tmp_path / "j")
    journal.reset("line-a", 1)
    journal.append([Followed(version=1), Followed(version=2)])
    journal.close()
    data = bytearray((tmp_path / "j").read_bytes())
    data[-25] ^= 0xFF  # inside the first record's body: the second follows it intact
    (tmp_path / "j").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"j: record at byte \d+ fails its checksum"):
        list(read_journal(tmp_path / "j")[1])
    (tmp_path / "k").write_bytes(b"not a journal")
    with pytest.raises(ValueError, match="not an asyncrl buffer journal"):
        read_journal(tmp_path / "k")


def test_checkpoints_and_journals_have_no_wire_frame_limit(tmp_path: Path, monkeypatch):
    """The wire's frame limit (256 MiB) guards sockets; a buffer's state past it must still
    be written and read (here the limit is cut to 64 bytes to show it without 256 MiB)."""
    from asyncrl.wire.codec import Codec

    monkeypatch.setitem(Codec.__init__.__kwdefaults__, "max_frame_bytes", 64)
    hub = new_hub(VersionedBuffer.Config(groups_per_step=2, num_samples_per_prompt=1))
    hub.hand_out("rollout-0", "r1", 2)
    hub.commit()
    write_checkpoint(hub.state_dict(), tmp_path / "buffer.ckpt")
    assert (tmp_path / "buffer.ckpt").stat().st_size > 64
    assert read_checkpoint(tmp_path / "buffer.ckpt") == hub.state_dict()
    journal = Journal(tmp_path / "j")
    journal.reset("line-a", 1)
    record = Handed(actor="rollout-0", request="r2", max_items=64, uids=["g" * 40] * 4)
    journal.append([record])
    journal.close()
    assert list(read_journal(tmp_path / "j")[1]) == [(1, record)]


# -- the hub -------------------------------------------------------------------------------
def test_asking_again_with_the_same_request_id_gets_the_same_work():
    hub = new_hub(VersionedBuffer.Config(groups_per_step=2, num_samples_per_prompt=1))
    first = hub.hand_out("rollout-0", "inc-1", 3)
    assert len(first) == 3
    assert hub.put(finished_group(over_the_wire(first[0]))) == "stored"
    # The reply was lost: the same id gets what is still in flight with it, nothing new.
    again = hub.hand_out("rollout-0", "inc-1", 3)
    assert [i.group_uid for i in again] == [i.group_uid for i in first[1:]]
    assert hub.buffer.ledger.admitted == 3
    fresh = hub.hand_out("rollout-0", "inc-2", 1)
    assert fresh and fresh[0].group_uid not in {i.group_uid for i in first}


def trained_batches(hub: Hub, steps: int, *, durable: int) -> list[TrainBatch]:
    """A trainer that takes ``steps`` batches, stepping after each (the ack rides on the
    next request) and reporting ``durable`` as its checkpoint."""
    batches: list[TrainBatch] = []
    for item in hub.hand_out("rollout-0", "r1", 100):
        hub.put(finished_group(over_the_wire(item)))
    acks: list[int] = []
    for _ in range(steps):
        version = hub.buffer.version
        hub.settle(version, acks, durable, resync=not batches)
        batch = hub.take(2)
        assert batch is not None and batch.step == version
        batches.append(batch)
        acks = [batch.batch_id]
        hub.follow(version + 1)
    hub.settle(hub.buffer.version, acks, durable, resync=False)
    return batches


def test_a_restarted_trainer_is_served_every_batch_after_its_checkpoint_again_in_order():
    cfg = VersionedBuffer.Config(groups_per_step=2, num_samples_per_prompt=1, max_staleness=8)
    hub = new_hub(cfg)
    batches = trained_batches(hub, 5, durable=2)  # its newest checkpoint: version 2
    assert [b.step for b in hub.outstanding.values()] == [2, 3, 4]  # 0 and 1 released
    consumed = hub.buffer.ledger.consumed
    hub.settle(2, [], 2, resync=True)  # the trainer restarted from version 2
    again = []
    for _ in range(3):
        batch = hub.take(2)
        assert batch is not None
        again.append(batch)
        hub.settle(batch.step + 1, [batch.batch_id], 2, resync=False)
    assert [b.batch_id for b in again] == [b.batch_id for b in batches[2:]]
    assert hub.buffer.ledger.consumed == consumed  # served again, consumed once
    following = hub.take(2)  # then new work
    assert following is not None and following.batch_id == batches[-1].batch_id + 1


def test_a_skipped_batch_is_served_again_in_its_place_and_skipped_again():
    """A batch the trainer skipped (no trainable group: the version stays) sits among the
    kept batches like any other. A trainer restarted from the checkpoint before it gets
    it again in order; skipping is a function of the batch alone, so it is skipped again,
    the next batch makes the same version, and no group counts as consumed twice."""
    cfg = VersionedBuffer.Config(groups_per_step=2, num_samples_per_prompt=1, max_staleness=8)
    hub = new_hub(cfg)
    trained_batches(hub, 2, durable=2)  # checkpoint at version 2
    hub.settle(2, [], 2, resync=False)
    skipped = hub.take(2)
    assert skipped is not None and skipped.step == 2
    hub.settle(2, [skipped.batch_id], 2, resync=False)  # acknowledged, version unchanged
    trained = hub.take(2)
    assert trained is not None and trained.step == 2  # the same step: nothing was trained
    hub.follow(3)
    consumed = hub.buffer.ledger.consumed
    # The trainer died before its checkpoint at 3; version 2 was made by batch 2.
    hub.settle(2, [], 2, resync=True, last_batch=2)
    again = hub.take(2)
    assert again is not None and again.batch_id == skipped.batch_id
    # Skipped again, and the buffer restarts before the next batch: the trainer resyncs
    # with the same last batch, however often its skipped batch was served.
    hub.settle(2, [again.batch_id], 2, resync=True, last_batch=2)
    assert hub.take(2).batch_id == skipped.batch_id
    hub.settle(2, [again.batch_id], 2, resync=False)
    then = hub.take(2)
    assert then is not None and then.batch_id == trained.batch_id
    hub.settle(3, [then.batch_id], 2, resync=False)
    assert hub.buffer.ledger.consumed == consumed and hub.buffer.lost_steps == 0
    following = hub.take(2)
    assert following is not None and following.step == 3
    assert following.batch_id > trained.batch_id


def test_a_batch_in_the_restarted_trainers_checkpoint_is_not_served_again():
    cfg = VersionedBuffer.Config(groups_per_step=2, num_samples_per_prompt=1, max_staleness=8)
    hub = new_hub(cfg)
    batches = trained_batches(hub, 2, durable=0)
    # The trainer trains a third batch, checkpoints version 3, and dies before its next
    # request (which would have acknowledged that batch).
    hub.settle(2, [], 0, resync=False)
    third = hub.take(2)
    assert third is not None and third.step == 2
    hub.follow(3)
    hub.settle(3, [], 3, resync=True)  # the restarted trainer, from checkpoint 3
    following = hub.take(2)
    assert following is not None and following.step == 3
    assert following.batch_id not in {b.batch_id for b in [*batches, third]}
    assert hub.buffer.lost_steps == 0 and not hub.outstanding.keys() - {following.batch_id}


def test_a_failed_journal_write_leaves_no_partial_record(tmp_path: Path, monkeypatch):
    journal = Journal(tmp_path / "j", fsync=True)
    journal.reset("line-a", 1)
    journal.append([Followed(version=1)])
    size = (tmp_path / "j").stat().st_size

    def disk_full(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("os.fsync", disk_full)
    with pytest.raises(OSError, match="No space left"):
        journal.append([Followed(version=2), Followed(version=3)])
    assert (tmp_path / "j").stat().st_size == size  # cut back to before the append
    monkeypatch.undo()
    journal.append([Followed(version=4)])
    journal.close()
    rows = list(read_journal(tmp_path / "j")[1])
    assert [r.version for _, r in rows] == [1, 4]


def test_a_trainer_that_resumes_behind_the_kept_batches_is_refused_and_changes_nothing():
    """Its checkpoints are gone (deleted, or never written: checkpoint_interval 0): going
    on would lose the steps between, or train their groups twice."""
    cfg = VersionedBuffer.Config(groups_per_step=2, num_samples_per_prompt=1, max_staleness=8)
    hub = new_hub(cfg)
    trained_batches(hub, 4, durable=3)  # the buffer keeps only step 3 on
    hub.commit()
    before = comparable(hub.state_dict())
    with pytest.raises(RunStateLost, match="resumed at version 1, but it had reached version 4"):
        hub.settle(1, [], 3, resync=True)  # but the trainer came back at version 1
    assert comparable(hub.state_dict()) == before  # nothing changed, nothing to journal
    hub.settle(3, [], 3, resync=True)  # from its checkpoint at 3: served again from there
    again = hub.take(2)
    assert again is not None and again.step == 3


def test_a_trainer_ahead_of_every_batch_the_buffer_made_is_refused():
    """The buffer's journal lost records (deleted or cut short, then --resume): it would
    hand out groups the trainer has trained as if they were new."""
    cfg = VersionedBuffer.Config(groups_per_step=2, num_samples_per_prompt=1, max_staleness=8)
    hub = new_hub(cfg)
    trained_batches(hub, 2, durable=2)
    with pytest.raises(RunStateLost, match="at version 5, but the buffer's state records only 2"):
        hub.settle(5, [], 5, resync=True)
    hub.settle(-1, [], 2, resync=True)  # an unknown version is not checked


def test_a_trainer_holding_a_batch_the_buffer_never_made_is_refused_though_its_version_fits():
    """Skipped batches make no version: a trainer at version 2 made by batch 4 (2 skipped)
    passes the version check against a buffer state that recorded 2 batches, yet that
    state lost the 2 after them and would serve their groups again."""
    cfg = VersionedBuffer.Config(groups_per_step=2, num_samples_per_prompt=1, max_staleness=8)
    hub = new_hub(cfg)
    trained_batches(hub, 2, durable=2)
    hub.commit()
    before = comparable(hub.state_dict())
    with pytest.raises(RunStateLost, match=r"holds batch 4 .* records only 2"):
        hub.settle(2, [], 2, resync=True, last_batch=4)
    assert comparable(hub.state_dict()) == before
    hub.settle(2, [], 2, resync=True, last_batch=2)  # the batch that made version 2
    following = hub.take(2)
    assert following is not None and following.batch_id == 3


def test_a_replay_that_diverges_from_its_journal_fails_loudly(tmp_path: Path):
    cfg = VersionedBuffer.Config(groups_per_step=1, num_samples_per_prompt=2)
    hub = new_hub(cfg, tmp_path / "journal")
    checkpoint(hub, tmp_path / "ckpt")
    (item,) = hub.hand_out("rollout-0", "r1", 1)
    hub.put(finished_group(over_the_wire(item)))
    hub.commit()
    hub.journal.close()
    rows = list(read_journal(tmp_path / "journal")[1])
    assert isinstance(rows[1][1], Returned) and rows[1][1].outcome == "stored"
    forged = [rows[0], (rows[1][0], Returned(group=rows[1][1].group, outcome="filtered"))]
    fresh = new_hub(cfg)
    fresh.load_state_dict(read_checkpoint(tmp_path / "ckpt"))
    with pytest.raises(ReplayDiverged, match="Returned replayed to 'stored'"):
        fresh.replay(forged)


def test_a_journal_of_another_lineage_is_ignored_and_a_gap_is_refused(tmp_path: Path):
    cfg = VersionedBuffer.Config(groups_per_step=1, num_samples_per_prompt=1)
    old = new_hub(cfg, tmp_path / "journal")
    checkpoint(old, tmp_path / "ckpt")
    old.hand_out("rollout-0", "r1", 2)
    old.commit()
    # A fresh start of another run wrote its checkpoint, then died before its journal.
    newer = new_hub(cfg)
    newer.commit()
    write_checkpoint(newer.state_dict(), tmp_path / "ckpt")
    recovered = new_hub(cfg)
    assert recover_hub(recovered, tmp_path / "ckpt", tmp_path / "journal") == 0
    assert recovered.buffer.ledger.admitted == 0
    # A journal that starts after the checkpoint's end: records are missing.
    old.journal.reset(newer.lineage, 7)
    # Permanent (RunStateLost): a restart would read the same bytes, so none is made.
    with pytest.raises(RunStateLost, match=r"starts at record 7 but .*ckpt ends at 0"):
        recover_hub(new_hub(cfg), tmp_path / "ckpt", tmp_path / "journal")
    (tmp_path / "journal").write_bytes(b"")  # a zero-byte journal: damaged, not empty
    with pytest.raises(RunStateLost, match=r"journal cannot be replayed: .*bad magic"):
        recover_hub(new_hub(cfg), tmp_path / "ckpt", tmp_path / "journal")


class Players:
    """Producers and a trainer around one hub, in random order (the property test)."""

    def __init__(self, hub: Hub, rng: random.Random) -> None:
        self.hub, self.rng = hub, rng
        self.held: dict[str, list[WorkItem]] = defaultdict(list)
        self.requests: dict[str, int] = defaultdict(int)
        self.delivered: list[Group] = []
        self.batch: TrainBatch | None = None  # taken, not yet trained
        self.acks: list[int] = []
        self.durable = 0
        self.resync = True

    def hand(self) -> None:
        actor = self.rng.choice(["rollout-0", "rollout-1"])
        self.requests[actor] += 1
        got = self.hub.hand_out(actor, f"{actor}-{self.requests[actor]}", self.rng.randint(1, 4))
        self.held[actor] += [over_the_wire(i) for i in got]

    def deliver(self) -> None:
        actor = self.rng.choice(sorted(self.held) or ["rollout-0"])
        if not self.held[actor]:
            return
        item = self.held[actor].pop(self.rng.randrange(len(self.held[actor])))
        v = self.hub.buffer.version
        make = self.rng.choice([finished_group, finished_group, aborted_group, failed_group])
        group = failed_group(item, "boom") if make is failed_group else make(item, versions=[v])
        self.delivered.append(group)
        self.hub.put(over_the_wire(group))

    def duplicate(self) -> None:
        if self.delivered:
            self.hub.put(over_the_wire(self.rng.choice(self.delivered)))

    def requeue(self) -> None:
        actor = self.rng.choice(["rollout-0", "rollout-1"])
        self.hub.requeue(actor)
        self.held.pop(actor, None)

    def train(self) -> None:
        """One trainer step; now and then several in a row, past the backstop at once,
        so that asynchronous APRIL cuts what still runs."""
        hard = self.hub.buffer.config.resolved_hard_staleness
        for _ in range(hard + 1 if self.rng.random() < 0.1 else 1):
            if not self._step():
                return

    def _step(self) -> bool:
        """One trainer request: acks, maybe a batch, a step after it."""
        version = self.hub.buffer.version
        self.hub.settle(version, self.acks, self.durable, self.resync)
        self.acks, self.resync = [], False
        batch = self.hub.take(self.hub.buffer.config.groups_per_step)
        if batch is None:
            return False
        self.acks = [batch.batch_id]
        self.hub.follow(version + 1)
        if self.rng.random() < 0.3:
            self.durable = version + 1
        return True

    def restart_trainer(self) -> None:
        """From its newest checkpoint: never refused (``_check_resync``)."""
        self.acks, self.resync = [], True
        self.hub.settle(self.durable, [], self.durable, resync=True)


ACTIONS = ["hand", "hand", "deliver", "deliver", "deliver", "duplicate", "requeue", "train",
           "train", "restart_trainer", "checkpoint"]  # fmt: skip


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(cfg=configs(), seed=st.integers(0, 2**32 - 1), steps=st.integers(10, 80))
def test_a_hub_rebuilt_from_checkpoint_and_journal_equals_the_one_that_died(
    cfg: VersionedBuffer.Config, seed: int, steps: int
):
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, journal = Path(tmp) / "buffer.ckpt", Path(tmp) / "buffer.journal"
        hub = new_hub(cfg, journal)
        checkpoint(hub, ckpt)
        players = Players(hub, rng)
        for _ in range(steps):
            action = rng.choice(ACTIONS)
            if action == "checkpoint":
                checkpoint(hub, ckpt)
            else:
                getattr(players, action)()
            hub.commit()  # before anyone hears of it, as the actor does
            hub.buffer.ledger.check()
        hub.journal.close()
        recovered = new_hub(cfg)
        recover_hub(recovered, ckpt, journal)
        assert comparable(recovered.state_dict()) == comparable(hub.state_dict())


def test_a_flipped_byte_in_a_buffer_checkpoint_is_refused_naming_the_file(tmp_path: Path):
    cfg = VersionedBuffer.Config(groups_per_step=2, num_samples_per_prompt=1, max_staleness=8)
    hub = new_hub(cfg)
    trained_batches(hub, 2, durable=2)
    hub.commit()
    path = tmp_path / "buffer.ckpt"
    write_checkpoint(hub.state_dict(), path)
    assert comparable(read_checkpoint(path)) == comparable(hub.state_dict())
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointUnreadable, match=f"{re.escape(str(path))} is unreadable.*"
                                                   "checksum does not match"):  # fmt: skip
        recover_hub(new_hub(cfg), path, None)
