"""A rollout producer in miniature, for buffer tests: builds the groups a producer sends back.

Work items and results cross a real ``Codec`` here (``over_the_wire``), as they do between
the BufferActor and a RolloutActor, so a test cannot pass because the buffer and the
producer share (and mutate) one object.

Users: ``tests/test_buffer.py``, ``tests/test_store.py``, ``tests/test_admission.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from asyncrl.types import Group, Prompt, Sample, SampleStatus, WorkItem
from asyncrl.wire.codec import Codec

T = TypeVar("T")
_WIRE: Codec[Any] = Codec(Group | WorkItem | Prompt | Sample)


def over_the_wire(msg: T) -> T:
    """``msg`` encoded and decoded: a private copy, exactly as a peer would receive it."""
    return _WIRE.decode(_WIRE.encode(msg))


def make_prompts(n: int, prefix: str = "p") -> list[Prompt]:
    """``n`` prompts with uids ``"<prefix>0"``, ``"<prefix>1"``, ..."""
    return [Prompt(uid=f"{prefix}{i}", prompt_id=f"{prefix}{i}", prompt=f"q{i}") for i in range(n)]


class ListSource:
    """A ``PromptSupply`` over a fixed list of prompts, with a checkpointable cursor."""

    def __init__(self, prompts: list[Prompt]) -> None:
        self.prompts = prompts
        self.cursor = 0

    @property
    def exhausted(self) -> bool:
        """True once every prompt was drawn."""
        return self.cursor >= len(self.prompts)

    def take(self, n: int) -> list[Prompt]:
        """Up to ``n`` more prompts."""
        out = self.prompts[self.cursor : self.cursor + n]
        self.cursor += len(out)
        return out

    def state_dict(self) -> dict[str, Any]:
        """The cursor."""
        return {"cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``."""
        self.cursor = state["cursor"]


def start_samples(item: WorkItem) -> list[Sample]:
    """The samples a producer works on: the partial ones when resumed, else fresh ones."""
    if item.partial is not None:
        return [over_the_wire(s) for s in item.partial.samples]
    return [
        Sample.for_prompt(item.prompt, group_id=item.group_uid, index=i, version=item.version)
        for i in range(item.num_samples)
    ]


def generate(sample: Sample, versions: Sequence[int]) -> None:
    """Append one token per entry of ``versions`` (the weight version that sampled it)."""
    start = sample.response_length
    tokens = [100 + start + i for i in range(len(versions))]
    logprobs = [-0.5] * len(versions)
    sample.append_response(tokens, logprobs, list(versions))
    sample.temperature = 1.0  # what a rollout actor records: the temperature sampled at


def finished_group(
    item: WorkItem,
    *,
    versions: Sequence[int] | Sequence[Sequence[int]] = (0,),
    rewards: Sequence[float | None] | None = None,
) -> Group:
    """Every unfinished sample of ``item`` generates ``versions`` tokens and completes.

    ``versions`` is one list for all samples or one list per sample; ``rewards`` defaults
    to ``0, 1, 0, 1, ...`` (non-zero variance, so dynamic-sampling filters keep it).
    """
    samples = start_samples(item)
    per_sample = _per_sample(versions, len(samples))
    rewards = [float(i % 2) for i in range(len(samples))] if rewards is None else rewards
    for sample, vs, reward in zip(samples, per_sample, rewards, strict=True):
        if not sample.is_done:
            generate(sample, vs)
            sample.status, sample.finish_reason = SampleStatus.COMPLETED, "stop"
            sample.reward = reward
    return Group(uid=item.group_uid, prompt_uid=item.prompt.uid, samples=samples)


def aborted_group(
    item: WorkItem,
    *,
    versions: Sequence[int] = (0,),
    aborted: Sequence[int] | None = None,
    finished_versions: Sequence[int] | None = None,
) -> Group:
    """Samples ``aborted`` (default: all) are cut off after ``versions`` new tokens; the rest
    complete with ``finished_versions`` (default ``versions``) and reward 1."""
    samples = start_samples(item)
    cut = set(range(len(samples)) if aborted is None else aborted)
    for sample in samples:
        if sample.is_done:
            continue
        if sample.index in cut:
            generate(sample, versions)
            sample.status, sample.finish_reason = SampleStatus.ABORTED, "abort"
        else:
            generate(sample, versions if finished_versions is None else finished_versions)
            sample.status, sample.reward = SampleStatus.COMPLETED, 1.0
    return Group(uid=item.group_uid, prompt_uid=item.prompt.uid, samples=samples)


def failed_group(item: WorkItem, error: str | None, *, index: int = 0) -> Group:
    """Sample ``index`` failed with ``error``; the others completed."""
    group = finished_group(item)
    group.samples[index].status = SampleStatus.FAILED
    group.samples[index].error = error
    group.samples[index].reward = None
    return group


def _per_sample(versions: Sequence[Any], n: int) -> list[Sequence[int]]:
    if versions and not isinstance(versions[0], int):
        return list(versions)
    return [versions] * n
