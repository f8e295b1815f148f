"""ServerGroup: the rollout actor's engine joins the trainer's weight group by SGLang's
routes, and leaves groups a predecessor of the actor left it in (against a recording
SGLang server; the whole path runs for real in ``test_engine_actor.py``)."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from asyncrl.engines.client.sglang import SGLangClient
from asyncrl.errors import InputError
from asyncrl.rollout.server_group import ServerGroup, server_buckets
from asyncrl.weights.config import GroupConfig
from asyncrl.weights.group import GroupMembership, claim_rank, may_join
from asyncrl.wire.blob import layout
from asyncrl.wire.sockets import free_tcp_endpoint, release_endpoints
from tests.test_sglang_client import FAST, Fake, serving


@contextlib.contextmanager
def rank_zero(world_size: int, join_timeout_s: float = 60.0) -> Iterator[GroupMembership]:
    """The trainer's side: a real rank 0 serving its store on a claimed loopback port."""
    endpoint = free_tcp_endpoint()
    cfg = GroupConfig(world_size=world_size, join_timeout_s=join_timeout_s)
    trainer = GroupMembership(cfg, rank=0, address=endpoint)
    trainer.open()
    release_endpoints([endpoint])
    try:
        yield trainer
    finally:
        if trainer._forming is not None:  # a thread inside torch at exit aborts the process
            trainer._forming.exception(timeout=30)
        trainer.close()


def forming(trainer: GroupMembership) -> str:
    """Rank 0 starts forming its next id (as before a version) and names it."""
    assert trainer.usable() is None
    return trainer.id


async def given_up(trainer: GroupMembership) -> None:
    """Wait until rank 0's forming has timed out."""
    assert trainer._forming is not None
    async with asyncio.timeout(30):
        with contextlib.suppress(Exception):
            await asyncio.wrap_future(trainer._forming)


async def test_the_engine_joins_each_forming_group_at_the_actors_rank_and_leaves_the_last():
    async with serving(Fake()) as fake, SGLangClient(fake.url, config=FAST) as client:
        with rank_zero(world_size=3, join_timeout_s=6.0) as trainer:
            host, port = trainer.address
            group = ServerGroup(trainer.cfg, rank=2, address=f"{host}:{port}", client=client)
            await group.check()
            first = forming(trainer)
            group.notice(first, formed=False)
            assert await group.for_version(first, formed=True) == f"asyncrl-weights-{first}"
            await given_up(trainer)  # rank 1 never came
            second = forming(trainer)
            group.notice(second, formed=False)  # the trainer re-formed
            assert await group.for_version(second, formed=True) == f"asyncrl-weights-{second}"
            await group.aclose()
    inits = fake.bodies("/init_weights_update_group")
    assert [b["group_name"] for b in inits] == [f"asyncrl-weights-{first}",
                                                f"asyncrl-weights-{second}"]  # fmt: skip
    assert inits[0] == {"master_address": host, "master_port": port, "rank_offset": 2,
                        "world_size": 3, "group_name": f"asyncrl-weights-{first}",
                        "backend": "gloo"}  # fmt: skip
    destroyed = [b["group_name"] for b in fake.bodies("/destroy_weights_update_group")]
    assert destroyed == [b["group_name"] for b in inits]  # on re-form, on close


async def test_an_id_the_trainer_gave_up_on_is_not_joined():
    """A server blocks while it joins (vLLM, SGLang: generation too) until every rank has
    come or its join times out: an engine that starts after the trainer gave up on an id
    must not join it, and joins the next one."""
    async with serving(Fake()) as fake, SGLangClient(fake.url, config=FAST) as client:
        with rank_zero(world_size=2, join_timeout_s=1.0) as trainer:
            host, port = trainer.address
            group = ServerGroup(trainer.cfg, rank=1, address=f"{host}:{port}", client=client)
            stale = forming(trainer)
            await given_up(trainer)  # nobody came within 1 s
            assert await group.for_version(stale, formed=False) is None
            await group._joining
            assert fake.bodies("/init_weights_update_group") == []
            # Had it formed (a predecessor's join made it), our engine would be in it: out.
            assert await group.for_version(stale, formed=True) is None
            assert fake.bodies("/destroy_weights_update_group") == [
                {"group_name": f"asyncrl-weights-{stale}"}
            ]
            fresh = forming(trainer)
            assert fresh != stale
            group.notice(fresh, formed=False)
            await group._joining
            await group.aclose()
    assert [b["group_name"] for b in fake.bodies("/init_weights_update_group")] == [
        f"asyncrl-weights-{fresh}"
    ]


async def test_an_id_a_predecessor_began_joining_is_not_joined_and_rank_0_gives_it_up():
    """The actor died while its engine was joining (and the engine with it): gloo holds
    the dead engine's address at this rank, so its successor's engine would wait on it
    with rank 0, generation stopped, past both timeouts. The successor asks for the next
    id instead, no other rank starts joining the stale id, and rank 0, told so, forms the
    next at its next version."""
    async with serving(Fake()) as fake, SGLangClient(fake.url, config=FAST) as client:
        with rank_zero(world_size=3, join_timeout_s=15.0) as trainer:
            host, port = trainer.address
            doomed = forming(trainer)
            store = dist.TCPStore(host, port, None, False, timeout=datetime.timedelta(seconds=5))
            assert claim_rank(store, doomed, 1) == ""  # the predecessor's claim
            group, other = (ServerGroup(trainer.cfg, rank=r, address=f"{host}:{port}",
                                        client=client) for r in (1, 2))  # fmt: skip
            for member in (group, other):  # the successor, then another actor's engine
                assert await member.for_version(doomed, formed=False) is None
                await member._joining
            assert fake.bodies("/init_weights_update_group") == []
            await other.aclose()
            doomed_forming = trainer._forming
            fresh = forming(trainer)  # the next version: the stale id is given up
            assert fresh != doomed and doomed_forming is not None and not doomed_forming.done()
            group.notice(fresh, formed=False)
            await group._joining
            await group.aclose()
            doomed_forming.exception(timeout=60)
    assert [b["group_name"] for b in fake.bodies("/init_weights_update_group")] == [
        f"asyncrl-weights-{fresh}"
    ]


def test_an_id_still_forming_past_its_timeout_is_given_up_at_the_next_version():
    """gloo's store phase and connect phase each wait the join timeout: rank 0 does not
    wait for both, and names the next id forming."""
    with rank_zero(world_size=2, join_timeout_s=5.0) as trainer:
        overdue = forming(trainer)
        overdue_forming = trainer._forming
        assert overdue_forming is not None
        assert trainer.usable() is None and trainer.id == overdue  # within its time
        trainer._since -= trainer.cfg.join_timeout_s + 11  # as if gloo still waited then
        assert trainer.usable() is None and trainer.id != overdue
        host, port = trainer.address
        assert may_join(host, port, overdue, 1).startswith("no longer forming")
        assert may_join(host, port, trainer.id, 1) == ""
        overdue_forming.exception(timeout=30)


async def test_a_formed_group_the_actor_never_joined_is_left_and_goes_by_disk():
    async with serving(Fake()) as fake, SGLangClient(fake.url, config=FAST) as client:
        group = ServerGroup(GroupConfig(world_size=2), rank=1, address="127.0.0.1:1",
                            client=client)  # fmt: skip
        assert await group.for_version("b7-3", formed=True) is None
    assert fake.bodies("/destroy_weights_update_group") == [{"group_name": "asyncrl-weights-b7-3"}]
    assert fake.bodies("/init_weights_update_group") == []


async def test_an_engine_of_several_ranks_is_refused():
    async with serving(Fake(tp_size=2)) as fake, SGLangClient(fake.url, config=FAST) as client:
        group = ServerGroup(GroupConfig(world_size=2), rank=1, address="127.0.0.1:1",
                            client=client)  # fmt: skip
        with pytest.raises(InputError, match="tp_size 1"):
            await group.check()


def test_buckets_are_announced_as_the_trainer_broadcasts_them():
    import torch

    tensors = {"big": torch.zeros(5 << 20), "a": torch.zeros(3), "b": torch.zeros(2, 2),
               "h": torch.zeros(4, dtype=torch.bfloat16)}  # fmt: skip
    calls = server_buckets(layout(tensors, chunk_bytes=64 << 20, blob="v"))
    assert [(c.names, c.load_format) for c in calls] == [
        (["big"], None),  # 20 MiB: sent as itself
        (["a", "b"], "flattened_bucket"),
        (["h"], None),  # another dtype: a bucket of its own
    ]
