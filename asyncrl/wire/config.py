"""``WireConfig``: the limits of the channels between actors (the ``wire`` config section).

Owned here, beside the channels it sets; the job's config tree composes it, and each actor
receives it in its ``ActorSpec`` (``Actor.wire``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from asyncrl.wire import security
from asyncrl.wire.codec import DEFAULT_MAX_FRAME_BYTES

KiB, MiB = 1024, 1024 * 1024


class WireConfig(BaseModel):
    """Limits of the channels between actors (see ``asyncrl.wire``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_frame_bytes: int = Field(
        DEFAULT_MAX_FRAME_BYTES, ge=MiB, description="largest frame accepted, bytes"
    )
    hwm: int = Field(1000, ge=1, description="zmq high-water mark of every socket, messages")
    batch_bytes: int = Field(256 * KiB, gt=0, description="reliable-channel batch size, bytes")
    window: int = Field(8192, ge=1, description="max unacknowledged reliable messages")
    redeliver_after: float = Field(2.0, gt=0, description="seconds before an unacked resend")
    chunk_bytes: int = Field(4 * MiB, gt=0, description="chunk size of the blob pull, bytes")
    curve_keys: str | None = Field(
        None,
        description="CurveZMQ: the job certificate's folder (asyncrl keys DIR); every channel "
        "is then encrypted and authenticated, and may bind non-loopback addresses",
    )

    @field_validator("curve_keys")
    @classmethod
    def _keys_load(cls, keys: str | None) -> str | None:
        if keys is not None:
            security.load(keys)  # missing, unreadable or world-readable: refused here
        return keys

    @model_validator(mode="after")
    def _fit_in_frames(self) -> WireConfig:
        for name in ("batch_bytes", "chunk_bytes"):
            if getattr(self, name) > self.max_frame_bytes:
                raise ValueError(
                    f"{name} ({getattr(self, name)}) must not exceed max_frame_bytes "
                    f"({self.max_frame_bytes}), since it travels in one frame"
                )
        return self
