"""The data model: prompts, token-exact samples, groups, train batches, and the buffer's
channel records that carry them (the wire's own protocol records are in ``wire/messages.py``).

Everything here is a wire ``Message`` (msgspec struct): one object goes from data source to
workflow, buffer, journal and trainer with no conversion. Token-exact: the trained tokens
are the sampled tokens. A sample's response columns (``T`` entries each) are one packed
little-endian buffer, read through read-only numpy views (one ``bytes`` field to decode,
not four arrays)::

    packed_response = tokens int32[T] | logprobs float32[T] | versions int32[T] | mask u8[T]

Prompt token ids are packed the same way (``int32[P]``).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from asyncrl.wire.codec import Message

__all__ = [
    "BatchReply",
    "BatchRequest",
    "BufferEvent",
    "ChatMessage",
    "Group",
    "Prompt",
    "Sample",
    "SampleStatus",
    "TrainBatch",
    "Turn",
    "WorkItem",
    "WorkReply",
    "WorkRequest",
    "pack_int32",
]

#: A chat message as the OpenAI/HF chat-template convention writes it.
ChatMessage = dict[str, Any]

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_U8 = np.dtype("u1")
_BYTES_PER_TOKEN = 13  # int32 token + float32 logprob + int32 version + u8 mask


def pack_int32(values: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as packed little-endian int32 bytes; raises if a value does not fit."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be one-dimensional, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
        raise ValueError("token ids must fit in int32")
    return arr.astype(_I32, copy=False).tobytes()


def _int32_view(raw: bytes) -> np.ndarray:
    return np.frombuffer(raw, dtype=_I32)


class Prompt(Message):
    """One draw of a data-source row: everything a rollout needs to start a group.

    ``uid`` is unique per draw (the same row drawn in a later epoch is a new prompt);
    ``prompt_id`` names the row itself (``"<source>:<row>"``), stable across epochs and
    restarts, so accounting and checkpoints can say which rows were consumed.
    """

    uid: str
    prompt_id: str
    prompt: str | list[ChatMessage]
    epoch: int = 0
    #: The prompt as the model sees it (chat template applied), when a tokenizer is set.
    text: str | None = None
    packed_prompt: bytes = b""
    label: Any = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    #: Tool schemas (JSON-schema function descriptions) offered to the model.
    tools: list[dict[str, Any]] | None = None

    @property
    def prompt_tokens(self) -> np.ndarray:
        """Prompt token ids, int32, read-only."""
        return _int32_view(self.packed_prompt)


class SampleStatus(enum.StrEnum):
    """Where a sample is in its life. Terminal: completed, truncated, filtered, failed."""

    PENDING = "pending"  # admitted, not yet generated (or being generated)
    COMPLETED = "completed"  # the model stopped (EOS, stop string, final answer)
    TRUNCATED = "truncated"  # hit max_new_tokens or the context/token budget
    ABORTED = "aborted"  # cut off by an abort (APRIL, weight update); resumable
    FILTERED = "filtered"  # dropped by a buffer filter; ``error`` holds the reason
    FAILED = "failed"  # the workflow, engine, reward or a tool raised; ``error`` says why


class Turn(Message):
    """A span ``[start, end)`` of response tokens produced by one actor of a multi-turn episode.

    ``role`` is ``"assistant"`` for sampled tokens, ``"tool"`` (or ``"user"``) for tokens
    appended from outside the model, which carry ``loss_mask = 0``.
    """

    start: int
    end: int
    role: str = "assistant"


class Sample(Message):
    """One response to one prompt, token-exact (``docs/design.md`` section 4).

    Response columns live in ``packed_response`` (layout in the module docstring) and are
    read through the properties; change them only with ``append_response``,
    ``set_loss_mask`` or ``truncate_response``, which keep the columns aligned.

    Head staleness when the trainer at version ``v`` consumes the sample::

        staleness(v) = v - min(token_versions)      (v - admitted_at_version if no tokens)
    """

    uid: str
    group_id: str
    index: int = 0
    prompt_id: str = ""
    prompt: str | list[ChatMessage] = ""
    packed_prompt: bytes = b""
    label: Any = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    #: The prompt's tool schemas (``Prompt.tools``): a multi-turn workflow offers these.
    tools: list[dict[str, Any]] | None = None
    response_text: str = ""
    packed_response: bytes = b""
    #: Spans of a multi-turn response; empty while the whole response is one assistant
    #: turn (the common case stays cheap on the wire). Read ``spans`` for the full list.
    turns: list[Turn] = msgspec.field(default_factory=list)
    reward: float | dict[str, float] | None = None
    status: SampleStatus = SampleStatus.PENDING
    finish_reason: str | None = None
    error: str | None = None
    admitted_at_version: int = 0
    attempts: int = 0
    timings: dict[str, float] = msgspec.field(default_factory=dict)
    #: Temperature the response was sampled at: the engine reports, and the trainer
    #: recomputes, log-probs under ``softmax(z / temperature)`` (1.0 when greedy). None
    #: until the rollout actor sets the rollout's (a workflow sampling at another sets
    #: its own; a branch left unset was sampled as its root). Last, so that records
    #: written before it (array-like) still decode.
    temperature: float | None = None
    #: Further samples of this one's trajectory that a branching workflow made (sub-agent
    #: calls, context-wipe segments, tree-search siblings): each trained as a row of its
    #: own with its own tokens, mask and versions, and this sample's advantage (design.md
    #: section 4). After ``temperature``, for the same reason.
    branches: list[Sample] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        # Runs on construction and on every decode, so a torn buffer never gets in.
        if len(self.packed_response) % _BYTES_PER_TOKEN or len(self.packed_prompt) % 4:
            raise ValueError(
                f"packed_response has {len(self.packed_response)} bytes (a multiple of "
                f"{_BYTES_PER_TOKEN}: token, logprob, version, mask) and packed_prompt "
                f"{len(self.packed_prompt)} (a multiple of 4: int32 ids)"
            )

    # -- read-only views ------------------------------------------------------------
    @property
    def response_length(self) -> int:
        """Number of response tokens ``T``."""
        return len(self.packed_response) // _BYTES_PER_TOKEN

    @property
    def prompt_tokens(self) -> np.ndarray:
        """Prompt token ids, int32[P], read-only."""
        return _int32_view(self.packed_prompt)

    @property
    def response_tokens(self) -> np.ndarray:
        """Sampled (and appended) token ids, int32[T], read-only."""
        return self._column(_I32, 0)

    @property
    def logprobs(self) -> np.ndarray:
        """Behaviour log-probs from the engine that sampled each token, float32[T]."""
        return self._column(_F32, 1)

    @property
    def token_versions(self) -> np.ndarray:
        """Weight version that produced each token, int32[T]."""
        return self._column(_I32, 2)

    @property
    def loss_mask(self) -> np.ndarray:
        """1 where a token is trained on, 0 for tool output and masked tokens; uint8[T]."""
        n = self.response_length
        return np.frombuffer(self.packed_response, dtype=_U8, count=n, offset=12 * n)

    def _column(self, dtype: np.dtype, slot: int) -> np.ndarray:
        n = self.response_length
        return np.frombuffer(self.packed_response, dtype=dtype, count=n, offset=4 * slot * n)

    @property
    def head_version(self) -> int:
        """The oldest weight version in the response and its branches'
        (``admitted_at_version`` if none has a token)."""
        heads = [int(x.token_versions.min()) for x in (self, *self.branches) if x.packed_response]
        return min(heads) if heads else self.admitted_at_version

    def staleness(self, version: int) -> int:
        """Head staleness at trainer version ``version``: ``version - head_version``."""
        return version - self.head_version

    @property
    def is_done(self) -> bool:
        """True once the sample reached a terminal status (not pending, not aborted)."""
        return self.status not in (SampleStatus.PENDING, SampleStatus.ABORTED)

    # -- the only writers of the response columns -------------------------------------
    def append_response(
        self,
        tokens: Sequence[int] | np.ndarray,
        logprobs: Sequence[float] | np.ndarray,
        versions: int | Sequence[int] | np.ndarray,
        *,
        loss_mask: int | Sequence[int] | np.ndarray = 1,
        role: str = "assistant",
        text: str = "",
    ) -> None:
        """Append one response segment; every column grows by ``len(tokens)`` or nothing does.

        ``versions`` and ``loss_mask`` may be scalars (one value for the whole segment).
        Log-probs of tokens not sampled by the model (tool output) are conventionally 0.
        Records the segment as a ``Turn`` and appends ``text`` to ``response_text``.
        """
        tok = np.asarray(tokens)
        n = tok.size
        columns = [
            _as_column(tok, _I32, n, "tokens"),
            _as_column(logprobs, _F32, n, "logprobs"),
            _as_column(versions, _I32, n, "versions"),
            _as_column(loss_mask, _U8, n, "loss_mask"),
        ]
        if n == 0:
            return
        start = self.response_length
        old = self._split() if start else [b""] * 4
        self.packed_response = b"".join(o + c.tobytes() for o, c in zip(old, columns, strict=True))
        self._extend_turns(start, start + n, role)
        self.response_text += text

    def _extend_turns(self, start: int, end: int, role: str) -> None:
        # A segment continuing the same role (an aborted turn resumed) extends that turn.
        if not self.turns and role == "assistant":
            return
        if not self.turns and start:
            self.turns.append(Turn(start=0, end=start, role="assistant"))
        if self.turns and self.turns[-1].role == role:
            self.turns[-1].end = end
        else:
            self.turns.append(Turn(start=start, end=end, role=role))

    @property
    def spans(self) -> list[Turn]:
        """The response's turns in order, covering ``[0, T)``; one span for a single turn."""
        if self.turns or not self.packed_response:
            return list(self.turns)
        return [Turn(start=0, end=self.response_length, role="assistant")]

    def set_loss_mask(self, mask: int | Sequence[int] | np.ndarray) -> None:
        """Replace the loss mask (same length as the response) e.g. to mask off-policy tokens."""
        n = self.response_length
        col = _as_column(mask, _U8, n, "loss_mask")
        self.packed_response = self.packed_response[: 12 * n] + col.tobytes()

    def truncate_response(self, length: int) -> None:
        """Keep the first ``length`` response tokens (all columns), dropping turns past it."""
        if not 0 <= length <= self.response_length:
            raise ValueError(f"cannot truncate {self.response_length} tokens to {length}")
        cols = self._split()
        widths = (4, 4, 4, 1)
        self.packed_response = b"".join(c[: w * length] for c, w in zip(cols, widths, strict=True))
        self.turns = [
            Turn(start=t.start, end=min(t.end, length), role=t.role)
            for t in self.turns
            if t.start < length
        ]

    def _split(self) -> list[bytes]:
        n, raw = self.response_length, self.packed_response
        return [raw[: 4 * n], raw[4 * n : 8 * n], raw[8 * n : 12 * n], raw[12 * n :]]

    @classmethod
    def for_prompt(cls, prompt: Prompt, *, group_id: str, index: int, version: int) -> Sample:
        """Pending sample of ``prompt``: the ``index``-th of its group, admitted at ``version``."""
        return cls(
            uid=f"{group_id}/{index}",
            group_id=group_id,
            index=index,
            prompt_id=prompt.prompt_id,
            prompt=prompt.prompt,
            packed_prompt=prompt.packed_prompt,
            label=prompt.label,
            metadata=dict(prompt.metadata),
            tools=prompt.tools,
            admitted_at_version=version,
        )


def _as_column(values: Any, dtype: np.dtype, n: int, name: str) -> np.ndarray:
    arr = np.asarray(values)
    if arr.ndim == 0:
        arr = np.full(n, arr)
    if arr.shape != (n,):
        raise ValueError(f"{name} has shape {arr.shape}, expected ({n},) to match the tokens")
    if dtype.kind in "iu" and arr.size and arr.dtype.kind not in "iub":
        raise TypeError(f"{name} must be integers, got dtype {arr.dtype}")
    if dtype == _U8 and arr.size and ((arr < 0) | (arr > 1)).any():
        raise ValueError(f"{name} must be 0 or 1")
    return arr.astype(dtype, copy=False)


class Group(Message):
    """The ``n`` samples of one prompt, trained together (GRPO needs all of them).

    ``uid`` identifies the group as a unit of work; ``prompt_uid`` is the ``Prompt.uid``
    it was drawn from, which accounting follows from admission to consumption.
    """

    uid: str
    prompt_uid: str
    samples: list[Sample]

    @property
    def head_version(self) -> int:
        """The oldest weight version of any token in the group."""
        return int(self.sample_head_versions().min())

    def sample_head_versions(self) -> np.ndarray:
        """Each sample's head version, int64[n], in one vectorised pass over the group."""
        versions, lengths = self._versions()
        heads = np.array([s.admitted_at_version for s in self.samples], dtype=np.int64)
        full = lengths > 0
        if full.any():
            starts = np.concatenate(([0], np.cumsum(lengths[full])[:-1]))
            heads[full] = np.minimum.reduceat(versions, starts)
        return heads

    def token_versions(self) -> np.ndarray:
        """Every response token's version, all samples concatenated, int32."""
        return self._versions()[0]

    def _versions(self) -> tuple[np.ndarray, np.ndarray]:
        """Every token's version, sample by sample (each with its branches' after its
        own), and each sample's count of them."""
        # Slicing the packed buffers and joining once beats a numpy view per sample.
        parts, lengths = [], []
        for sample in self.samples:
            total = 0
            for one in (sample, *sample.branches):
                raw = one.packed_response
                n = len(raw) // _BYTES_PER_TOKEN
                total += n
                if n:
                    parts.append(raw[8 * n : 12 * n])
            lengths.append(total)
        return np.frombuffer(b"".join(parts), dtype=_I32), np.array(lengths, dtype=np.int64)

    def staleness(self, version: int) -> int:
        """Head staleness of the group at trainer version ``version``."""
        return version - self.head_version

    @property
    def is_done(self) -> bool:
        """True when every sample reached a terminal status."""
        return all(s.is_done for s in self.samples)

    @property
    def rewards(self) -> np.ndarray:
        """Scalar rewards, float64[n]; a dict reward contributes its ``"score"`` entry."""
        return np.array([_scalar_reward(s.reward) for s in self.samples], dtype=np.float64)

    @property
    def num_tokens(self) -> int:
        """Response tokens over all samples."""
        return sum(s.response_length for s in self.samples)


def _scalar_reward(reward: float | dict[str, float] | None) -> float:
    if reward is None:
        return float("nan")
    if isinstance(reward, dict):
        return float(reward.get("score", float("nan")))
    return float(reward)


class TrainBatch(Message):
    """Groups handed to the trainer for one optimizer step.

    ``step`` is the trainer version the batch is meant for (its staleness reference);
    ``batch_id`` lets the trainer acknowledge it so the buffer marks the groups consumed.
    """

    batch_id: int
    step: int
    groups: list[Group]

    @property
    def samples(self) -> list[Sample]:
        """All samples, group by group."""
        return [s for g in self.groups for s in g.samples]


class WorkItem(Message):
    """One group of work handed by the buffer to a rollout actor.

    ``partial`` holds the samples generated so far when the group is resumed (APRIL
    over-provisioning or an abort on weight update, or a requeue after a producer
    crashed): resume each unfinished sample from its tokens with ``max_new_tokens``
    reduced by ``response_length``. ``version`` is the trainer version when handed out.
    """

    group_uid: str
    prompt: Prompt
    num_samples: int
    version: int
    attempt: int = 1
    partial: Group | None = None


# -- the buffer's channels (``actors/buffer.py``) ----------------------------------------


class WorkRequest(Message):
    """A rollout actor asks for up to ``max_items`` groups, waiting up to ``wait`` s.

    ``version`` is the weight version its engines serve (-1: unknown). Admission counts a
    group as started at the buffer's version, so a producer whose engines still serve an
    older one gets nothing until it has loaded the new weights: otherwise its tokens would
    be a version older than admission assumed, and staleness could pass ``eta``.
    """

    actor: str
    max_items: int
    wait: float = 1.0
    version: int = -1
    asleep: bool = False  # colocated: this actor's engines have released their memory
    #: Unique per request of one producer incarnation; asking again with the same id
    #: (its reply was lost) gets the same groups, not new ones. Empty: no such guarantee.
    request: str = ""


class WorkReply(Message):
    """Work to do (maybe none yet); ``exhausted`` means no more will ever come. ``sleep``
    (colocated jobs): no work until the trainer's next version, so an idle actor may
    release its engines' memory for the train step."""

    items: list[WorkItem]
    version: int
    exhausted: bool = False
    sleep: bool = False


class BatchRequest(Message):
    """The trainer asks for a batch of ``num_groups`` (0: the configured B).

    ``ack``: batches whose optimizer step is done; an unacknowledged batch is served again
    before any new one (its reply may have been lost). ``durable``: the version of the
    trainer's newest checkpoint (-1: none), whose batches are released; a trainer restarted
    from it sends ``resync=True`` with its version to be served every later batch again.
    ``take=False`` only acknowledges. ``version``: the trainer's weight version, which the
    buffer follows from here too (a pub/sub announcement just before a stop may be lost).
    ``last_batch``: the id of the batch that made its version (-1: unknown); every batch up
    to it is in its weights, trained or skipped, and a resync beyond what the buffer handed
    out is refused.
    """

    trainer: str
    num_groups: int = 0
    wait: float = 1.0
    ack: list[int] = msgspec.field(default_factory=list)
    resync: bool = False
    take: bool = True
    version: int = -1
    durable: int = -1
    last_batch: int = -1


class BatchReply(Message):
    """A batch, or None when none was ready in time; ``exhausted``: the data is used up."""

    batch: TrainBatch | None
    exhausted: bool = False


class BufferEvent(Message):
    """Published to rollout actors. ``kind="abort"`` (topic ``events``): abort every
    request in flight (synchronous APRIL). ``kind="cancel"`` (topic ``cancel``): abort
    ``groups``, the groups asynchronous APRIL cut as too stale whose results are not back
    yet (all of them, so an event that replaces an unread one loses none)."""

    kind: str
    version: int
    groups: list[str] = msgspec.field(default_factory=list)
