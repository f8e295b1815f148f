"""Branching workflows: a workflow returns its sample and the branches of its trajectory
(``actors/rollout.py::attach_branches``); each branch is a row of its own with its own
tokens, mask and versions, and takes its sample's advantage (``policies/objective.py``);
the group's staleness counts the branches' tokens; a real job trains on them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import uvloop

from asyncrl.actors.rollout import attach_branches
from asyncrl.buffer.dump import batch_files, read_batch
from asyncrl.config import load_config
from asyncrl.job import run_job
from asyncrl.policies import PolicyConfig, compute_advantages
from asyncrl.rollout.base import RolloutContext
from asyncrl.rollout.single_turn import single_turn
from asyncrl.trainers.rl_columns import update_plan
from asyncrl.trainers.rollout_tensors import rollout_tensors
from asyncrl.trainers.torch_trainer import TorchTrainer
from asyncrl.types import Group, Sample, SampleStatus, TrainBatch
from tests.test_torch_trainer import config
from tests.test_train import job_flags, write_prompts
from tests.tiny_model import build_tiny_model


def finished(
    uid: str, tokens: list[int], version: int = 0, reward: float = 1.0, temperature: float = 1.0
) -> Sample:
    s = Sample(uid=uid, group_id="g", packed_prompt=np.array([5, 6, 7], np.int32).tobytes(),
               temperature=temperature)  # fmt: skip
    s.append_response(tokens, [-0.5] * len(tokens), version)
    s.status, s.reward = SampleStatus.COMPLETED, reward
    return s


# --------------------------------------------------------------------- the workflow contract


def test_the_root_keeps_its_finished_branches_under_its_group_and_uid():
    root, b0, b1 = finished("g/0", [1, 2]), finished("x", [3]), finished("y", [4, 5, 6])
    root.index, root.admitted_at_version = 2, 4
    attach_branches(root, [b0, root, b1])
    assert [b.uid for b in root.branches] == ["g/0/b0", "g/0/b1"]
    assert all(b.group_id == "g" and b.index == 2 and b.admitted_at_version == 4
               for b in root.branches)  # fmt: skip
    assert root.branches[1].response_tokens.tolist() == [4, 5, 6]
    attach_branches(plain := finished("g/1", [1]), plain)  # no list: no branches
    assert plain.branches == []


@pytest.mark.parametrize(
    ("result", "message"),
    [
        (lambda root: finished("other", [1]), "must return the sample it was given"),
        (lambda root: [finished("other", [1])], "must return the sample it was given"),
        (lambda root: [root, "text"], "branch 0 is a str, not a Sample"),
        (lambda root: [root, Sample(uid="p", group_id="g")], "branch 0 is pending"),
        (lambda root: [root, _no_tokens()], "branch 0 has no prompt or no response tokens"),
    ],
)
def test_a_broken_contract_is_named(result, message):
    root = finished("g/0", [1])
    with pytest.raises(TypeError, match=message):
        attach_branches(root, result(root))


def _no_tokens() -> Sample:
    s = Sample(uid="e", group_id="g", packed_prompt=np.array([1], np.int32).tobytes())
    s.status = SampleStatus.COMPLETED
    return s


def test_an_aborted_root_keeps_no_branches_its_rerun_makes_them_again():
    root = finished("g/0", [1])
    root.status = SampleStatus.ABORTED
    cut = finished("c", [3])
    cut.status = SampleStatus.ABORTED  # the same abort cut a branch: not an error
    attach_branches(root, [root, finished("b", [2]), cut])
    assert root.branches == []


# ------------------------------------------------------------------------- trainer columns


def branched_batch() -> TrainBatch:
    """Two groups of two; sample g0/1 has two branches, g1/0 one (older versions)."""
    g0 = [finished("0/0", [1, 2], reward=1.0), finished("0/1", [3], reward=0.0)]
    g1 = [finished("1/0", [4, 5, 6], reward=2.0), finished("1/1", [7], reward=1.0)]
    attach_branches(g0[1], [g0[1], finished("a", [8, 9]), finished("b", [10], version=0)])
    attach_branches(g1[0], [finished("c", [11, 12, 13, 14]), g1[0]])
    return TrainBatch(batch_id="b", step=1, groups=[
        Group(uid="0", prompt_uid="p0", samples=g0), Group(uid="1", prompt_uid="p1", samples=g1),
    ])  # fmt: skip


def test_branches_are_rows_of_their_own_after_the_samples():
    rows = rollout_tensors(branched_batch())
    assert rows.num_rows == 4 + 3 and rows.branch_roots == [1, 1, 2]
    assert rows.sequences[4].tolist() == [5, 6, 7, 8, 9]  # the branch's prompt and response
    assert rows.mask[6].sum() == 4 and rows.scores_GN.tolist() == [[1.0, 0.0], [2.0, 1.0]]
    assert rows.row_groups() == [0, 0, 1, 1, 0, 0, 1]
    # A mini-batch of one group takes its branches along.
    assert update_plan(rows, 2, 1) == [[0, 1, 4, 5], [2, 3, 6]]


def test_a_branch_takes_its_samples_advantage_and_its_kl_counts_in_the_samples():
    rows = rollout_tensors(branched_batch())
    roots = torch.tensor(rows.branch_roots)
    adv, _ = compute_advantages(PolicyConfig(), rows.scores_GN, rows.mask, branch_roots=roots)
    per_sample = [float(adv[i][rows.mask[i].bool()][0]) for i in range(rows.num_rows)]
    assert per_sample[4] == per_sample[5] == per_sample[1] and per_sample[6] == per_sample[2]
    assert per_sample[1] < 0 < per_sample[0]  # GRPO within the group of two
    assert torch.equal(adv[4] != 0, rows.mask[4].bool())  # on the branch's own loss tokens
    # KL shaping: a trajectory's KL is its sample's tokens' and its branches'.
    kl = rows.mask * 0.1
    shaped, _ = compute_advantages(PolicyConfig(kl_coef=1.0), rows.scores_GN, rows.mask,
                                   kl_BT=kl, branch_roots=roots)  # fmt: skip
    seq_kl = torch.tensor([[0.2, 0.1 + 0.3], [0.3 + 0.4, 0.1]])
    want, _ = compute_advantages(PolicyConfig(), rows.scores_GN - seq_kl, rows.mask[:4])
    assert torch.allclose(shaped[:4], want, atol=1e-6)
    with pytest.raises(ValueError, match="branching workflow needs a sequence-level"):
        per_token = PolicyConfig(advantage_estimator="reinforce_pp", normalize_advantages=True)
        compute_advantages(per_token, rows.scores_GN, rows.mask, branch_roots=roots)


def test_the_trainer_trains_the_branches_tokens(tmp_path):
    build_tiny_model(tmp_path / "model")
    batch = branched_batch()
    result = TorchTrainer(config(tmp_path / "model")).train_step(batch)
    assert result.metrics["num_tokens"] == 2 + 1 + 3 + 1 + (2 + 1 + 4)  # samples + branches
    plain = TrainBatch(batch_id="p", step=1, groups=[
        Group(uid=g.uid, prompt_uid=g.prompt_uid,
              samples=[Sample(**{**_fields(s), "branches": []}) for s in g.samples])
        for g in branched_batch().groups
    ])  # fmt: skip
    without = TorchTrainer(config(tmp_path / "model")).train_step(plain)
    assert without.metrics["num_tokens"] == 7 and result.metrics["loss"] != without.metrics["loss"]


def _fields(s: Sample) -> dict:
    return {f: getattr(s, f) for f in s.__struct_fields__}


def test_the_groups_staleness_counts_its_branches_tokens():
    group = branched_batch().groups[0]
    old = finished("old", [1], version=0)
    young = finished("0/0", [1, 2], version=5)
    attach_branches(young, [young, old])
    group.samples[0] = young
    assert young.head_version == 0 and group.sample_head_versions().tolist() == [0, 0]
    assert sorted(group.token_versions().tolist()) == [0, 0, 0, 0, 0, 5, 5]


# ---------------------------------------------------------------------------- a real job


async def sub_agent(ctx: RolloutContext, sample: Sample) -> list[Sample]:
    """A workflow that first lets a sub-agent answer the prompt (a branch with a prompt of
    its own), then answers itself: the root carries the reward of the trajectory."""
    prompt = np.concatenate([sample.prompt_tokens, sample.prompt_tokens]).astype(np.int32)
    helper = Sample(uid=f"{sample.uid}/helper#{sample.attempts}", group_id=sample.group_id,
                    packed_prompt=prompt.tobytes(), label=sample.label)  # fmt: skip
    await single_turn(ctx, helper)
    await single_turn(ctx, sample)
    return [sample, helper]


@pytest.mark.slow
def test_a_branching_workflow_trains_in_a_real_job(tmp_path):
    build_tiny_model(tmp_path / "model")
    write_prompts(tmp_path / "prompts.jsonl")
    flags = [*job_flags(tmp_path, steps=2), "--rollout.workflow", "tests.test_branching:sub_agent",
             "--save-debug-rollout-data", str(tmp_path / "dump")]  # fmt: skip
    result = uvloop.run(run_job(load_config(overrides=flags)))
    assert result.ok, result.error
    run = tmp_path / "run"
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    batch = read_batch(batch_files(tmp_path / "dump")[0])
    samples = [s for g in batch.groups for s in g.samples]
    assert all(len(s.branches) == 1 for s in samples)
    branch = samples[0].branches[0]
    assert branch.uid == f"{samples[0].uid}/b0" and branch.response_length > 0
    assert len(branch.prompt_tokens) == 2 * len(samples[0].prompt_tokens)
    tokens = sum(x.response_length for s in samples for x in (s, *s.branches))
    loss_tokens = sum(int(x.loss_mask.sum()) for s in samples for x in (s, *s.branches))
    assert rows[0]["num_tokens"] == loss_tokens and tokens > sum(s.response_length for s in samples)


def test_a_branch_is_trained_at_its_roots_temperature_unless_it_says_another():
    root = finished("g/0", [1], temperature=0.7)
    default, own, one = finished("a", [2]), finished("b", [3], 0, 1.0, 0.5), finished("c", [4])
    default.temperature = None  # set by no one: sampled as its root was
    attach_branches(root, [root, default, own, one])
    assert [b.temperature for b in root.branches] == [0.7, 0.5, 1.0]


def test_a_resumed_groups_old_tokens_are_masked_in_its_branches_too():
    from asyncrl.buffer.april import mask_resumed_tokens

    root = finished("g/0", [1, 2], version=3)
    attach_branches(root, [root, finished("a", [4, 5, 6], version=1)])
    group = Group(uid="g", prompt_uid="p", samples=[root])
    assert mask_resumed_tokens(group, resumed_at_version=2) == 3  # the branch's three
    assert root.loss_mask.tolist() == [1, 1] and root.branches[0].loss_mask.tolist() == [0, 0, 0]
