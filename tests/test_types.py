"""The data model: token-exact samples keep their columns aligned and survive the wire."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.types import Group, Prompt, Sample, SampleStatus, TrainBatch, Turn, pack_int32
from asyncrl.wire.codec import Codec
from asyncrl.wire.errors import WireError

CODEC = Codec(Sample | Group | Prompt | TrainBatch)


def make_sample(n: int = 5, version: int = 3) -> Sample:
    sample = Sample(uid="g/0", group_id="g", packed_prompt=pack_int32([7, 8, 9]))
    sample.append_response(np.arange(n), np.linspace(-1, 0, n), version)
    return sample


def roundtrip(msg):
    return CODEC.decode(CODEC.encode(msg))


def test_append_response_grows_every_column_together():
    sample = make_sample(4, version=2)
    sample.append_response([10, 11], [-0.5, -0.25], [3, 4], loss_mask=0, role="tool")
    assert sample.response_tokens.tolist() == [0, 1, 2, 3, 10, 11]
    assert sample.logprobs.dtype == np.float32 and sample.logprobs[-1] == np.float32(-0.25)
    assert sample.token_versions.tolist() == [2, 2, 2, 2, 3, 4]
    assert sample.loss_mask.tolist() == [1, 1, 1, 1, 0, 0]
    assert sample.response_length == 6


@pytest.mark.parametrize(
    ("logprobs", "versions", "mask", "match"),
    [
        ([0.0], 1, 1, "logprobs has shape"),
        ([0.0, 0.0], [1, 2, 3], 1, "versions has shape"),
        ([0.0, 0.0], 1, [1], "loss_mask has shape"),
        ([0.0, 0.0], 1, [1, 2], "loss_mask must be 0 or 1"),
    ],
)
def test_misaligned_segment_raises_and_changes_nothing(logprobs, versions, mask, match):
    sample = make_sample(3)
    before = sample.packed_response
    with pytest.raises(ValueError, match=match):
        sample.append_response([1, 2], logprobs, versions, loss_mask=mask)
    assert sample.packed_response == before and sample.response_length == 3


def test_float_token_ids_are_refused():
    with pytest.raises(TypeError, match="tokens must be integers"):
        make_sample().append_response([1.5], [0.0], 1)


def test_token_ids_must_fit_int32():
    with pytest.raises(ValueError, match="int32"):
        pack_int32([2**31])


def test_views_are_read_only():
    sample = make_sample()
    with pytest.raises(ValueError):
        sample.response_tokens[0] = 5


def test_single_turn_has_no_turn_records_but_one_span():
    sample = make_sample(4)
    sample.append_response([5], [0.0], 4)  # a resumed continuation of the same turn
    assert sample.turns == []
    assert sample.spans == [Turn(start=0, end=5, role="assistant")]


def test_multi_turn_spans_cover_the_response():
    sample = make_sample(3)
    sample.append_response([1, 2], [0, 0], 3, loss_mask=0, role="tool")
    sample.append_response([4], [-1.0], 4)
    assert sample.spans == [
        Turn(start=0, end=3, role="assistant"),
        Turn(start=3, end=5, role="tool"),
        Turn(start=5, end=6, role="assistant"),
    ]


def test_truncate_keeps_columns_and_turns_aligned():
    sample = make_sample(3)
    sample.append_response([1, 2], [0, 0], 5, loss_mask=0, role="tool")
    sample.truncate_response(4)
    assert sample.response_tokens.tolist() == [0, 1, 2, 1]
    assert sample.token_versions.tolist() == [3, 3, 3, 5]
    assert sample.loss_mask.tolist() == [1, 1, 1, 0]
    assert sample.spans[-1] == Turn(start=3, end=4, role="tool")
    with pytest.raises(ValueError, match="cannot truncate"):
        sample.truncate_response(9)


def test_set_loss_mask_masks_off_policy_tokens():
    sample = make_sample(4)
    sample.set_loss_mask(sample.token_versions >= 4)
    assert sample.loss_mask.tolist() == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="loss_mask has shape"):
        sample.set_loss_mask([1])


def test_head_version_and_staleness():
    sample = make_sample(2, version=5)
    sample.append_response([3], [0.0], 7)
    assert sample.head_version == 5 and sample.staleness(9) == 4
    empty = Sample(uid="x", group_id="g", admitted_at_version=2)
    assert empty.head_version == 2
    group = Group(uid="g", prompt_uid="p@0", samples=[sample, empty])
    assert group.head_version == 2 and group.staleness(3) == 1


def test_group_rewards_take_score_from_dict_rewards():
    a, b, c = make_sample(), make_sample(), make_sample()
    a.reward, b.reward = 1.0, {"score": 0.5, "format": 1.0}
    rewards = Group(uid="g", prompt_uid="p@0", samples=[a, b, c]).rewards
    assert rewards[:2].tolist() == [1.0, 0.5] and np.isnan(rewards[2])


def test_for_prompt_copies_identity_and_prompt():
    prompt = Prompt(uid="d:3@1", prompt_id="d:3", prompt="2+2=", packed_prompt=pack_int32([4]))
    sample = Sample.for_prompt(prompt, group_id="grp", index=2, version=6)
    assert (sample.uid, sample.prompt_id, sample.admitted_at_version) == ("grp/2", "d:3", 6)
    assert sample.prompt_tokens.tolist() == [4] and sample.status is SampleStatus.PENDING


def test_sample_roundtrip_is_bit_exact():
    sample = make_sample(7)
    sample.append_response([9], [float("-inf")], 8, loss_mask=0, role="tool")
    sample.reward, sample.status, sample.metadata = (
        {"score": 1.0},
        SampleStatus.COMPLETED,
        {"k": [1]},
    )
    back = roundtrip(sample)
    assert back == sample
    assert back.logprobs.tobytes() == sample.logprobs.tobytes()
    assert back.spans == sample.spans


def test_train_batch_roundtrip():
    group = Group(uid="g", prompt_uid="p@0", samples=[make_sample(), make_sample(2)])
    batch = TrainBatch(batch_id=1, step=4, groups=[group])
    back = roundtrip(batch)
    assert back == batch and len(back.samples) == 2


def test_torn_packed_response_is_refused_on_decode():
    sample = make_sample(2)
    body = CODEC.encode(sample)[0]
    torn = body.replace(sample.packed_response, sample.packed_response[:-1]).replace(
        b"\xc4\x1a", b"\xc4\x19"
    )
    with pytest.raises(WireError, match="packed_response"):
        CODEC.decode([torn])


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 6),
            st.integers(0, 50),
            st.booleans(),
            st.sampled_from(["assistant", "tool", "user"]),
        ),
        max_size=6,
    )
)
def test_any_sequence_of_segments_stays_aligned_and_roundtrips(segments):
    sample = Sample(uid="s", group_id="g")
    tokens, versions, masks = [], [], []
    for n, version, trainable, role in segments:
        ids = list(range(len(tokens), len(tokens) + n))
        sample.append_response(ids, [-0.1] * n, version, loss_mask=int(trainable), role=role)
        tokens += ids
        versions += [version] * n
        masks += [int(trainable)] * n
    assert sample.response_tokens.tolist() == tokens
    assert sample.token_versions.tolist() == versions
    assert sample.loss_mask.tolist() == masks
    spans = sample.spans
    assert [(s.start, s.end) for s in spans] == sorted((s.start, s.end) for s in spans)
    assert sum(s.end - s.start for s in spans) == len(tokens)
    assert all(a.end == b.start for a, b in itertools.pairwise(spans))
    assert roundtrip(sample) == sample
