"""ServerGroup: the rollout actor's engine joins the trainer's weight group by SGLang's
routes, and leaves groups a predecessor of the actor left it in (against a recording
SGLang server; the whole path runs for real in ``test_engine_actor.py``)."""

from __future__ import annotations

import pytest

from asyncrl.engines.client.sglang import SGLangClient
from asyncrl.errors import InputError
from asyncrl.rollout.server_group import ServerGroup, server_buckets
from asyncrl.weights.config import GroupConfig
from asyncrl.wire.blob import layout
from tests.test_sglang_client import FAST, Fake, serving


async def test_the_engine_joins_each_forming_group_at_the_actors_rank_and_leaves_the_last():
    async with serving(Fake()) as fake, SGLangClient(fake.url, config=FAST) as client:
        group = ServerGroup(GroupConfig(world_size=3), rank=2, address="10.0.0.5:29500",
                            client=client)  # fmt: skip
        await group.check()
        group.notice("a1-1", formed=False)
        assert await group.for_version("a1-1", formed=True) == "asyncrl-weights-a1-1"
        group.notice("a1-2", formed=False)  # the trainer re-formed
        assert await group.for_version("a1-2", formed=True) == "asyncrl-weights-a1-2"
        await group.aclose()
    inits = fake.bodies("/init_weights_update_group")
    assert [b["group_name"] for b in inits] == ["asyncrl-weights-a1-1", "asyncrl-weights-a1-2"]
    assert inits[0] == {"master_address": "10.0.0.5", "master_port": 29500, "rank_offset": 2,
                        "world_size": 3, "group_name": "asyncrl-weights-a1-1",
                        "backend": "gloo"}  # fmt: skip
    destroyed = [b["group_name"] for b in fake.bodies("/destroy_weights_update_group")]
    assert destroyed == ["asyncrl-weights-a1-1", "asyncrl-weights-a1-2"]  # on re-form, on close


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
