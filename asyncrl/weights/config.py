"""``GroupConfig``: where a weight broadcast group (``weights/group.py``) meets, and the
gate that keeps its keyless sockets on loopback unless the network is trusted."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.errors import InputError
from asyncrl.wire.sockets import is_loopback


class GroupConfig(BaseModel):
    """Where a weight broadcast group meets, and this process's place in it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str | None = Field(
        None,
        description="host:port of rank 0 (the trainer), which serves the store; "
        "None: the job's trainer.group endpoint",
    )
    world_size: int = Field(ge=2, description="1 + subscribers")
    rank: int | None = Field(
        None, ge=0, description="0: the trainer; None: the trainer 0, rollout-i i + 1"
    )
    backend: str = "gloo"
    trusted_network: bool = Field(
        False,
        description="rank 0's store and gloo's sockets take no key: let them listen beyond "
        "loopback, on a network trusted not to reach them",
    )
    timeout_s: float = Field(
        60.0,
        gt=0,
        description="each collective: a rank that never comes fails the others' "
        "broadcast after this long (a rank that dies fails it at once); the group then "
        "re-forms and that version goes to the late rank by pull",
    )
    join_timeout_s: float = Field(
        60.0,
        gt=0,
        description="forming the group: it forms only when every rank arrives; "
        "until then, and after this long, versions go by pull and it is tried again",
    )
    bucket_bytes: int = Field(
        64 * 1024 * 1024,
        gt=0,
        description="bytes per broadcast bucket (two in flight), as slime's "
        "--update-weight-buffer-size",
    )


def check_group_host(address: str, *, trusted: bool) -> None:
    """``InputError`` when rank 0 would serve the group beyond loopback on a network
    not marked trusted: its store and gloo's sockets take no key (torch has none)."""
    host = address.removeprefix("tcp://").rpartition(":")[0].strip("[]")
    if trusted or is_loopback(host):
        return
    raise InputError(
        f"the dist weight group would listen on {host} (rank 0's store and gloo's "
        "sockets), which take no key: anyone who reaches them can read and write the "
        "group's keys and weights, --wire.curve-keys or not. On a trusted network set "
        "--train.dist-trusted-network true; elsewhere use --update-weight-transport pull "
        "(its channel is encrypted and authenticated with the keys)"
    )
