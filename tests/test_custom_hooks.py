"""Custom advantage and loss functions by path (``algo.custom_advantage_path``,
``algo.custom_loss_path``; asyncrl/policies/objective.py): the documented signatures,
their results used as the built-ins' are, and bad hooks refused by name."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from asyncrl.plugins import PluginError
from asyncrl.policies import LossInputs, LossScale, PolicyConfig, compute_advantages, rl_loss
from asyncrl.policies.advantages import group_advantages
from asyncrl.policies.losses import policy_loss
from asyncrl.policies.objective import load_hooks
from asyncrl.trainers.torch_trainer import TorchTrainer
from tests.test_mini_batches import tiny, weights  # noqa: F401 (fixture)
from tests.test_torch_trainer import config, make_batch

HERE = "tests.test_custom_hooks"


def grpo_by_hand(scores_GN, mask_BT, kl_BT):
    """[G, N]: the sample's advantage, spread over its tokens by asyncrl."""
    return group_advantages(scores_GN, "grpo")


def centred_per_token(scores_GN, mask_BT, kl_BT):
    """[B, T]: a token's advantage; padding is masked afterwards."""
    centred = scores_GN - scores_GN.mean(dim=1, keepdim=True)
    return centred.reshape(-1, 1).expand_as(mask_BT) + 100.0 * (1 - mask_BT)


def wrong_shape(scores_GN, mask_BT, kl_BT):
    return torch.zeros(3)


def ppo_by_hand(x: LossInputs, weights, scale: LossScale):
    """The built-in surrogate, called as the hook's signature allows."""
    return policy_loss(x.logprobs, x.old_logprobs, x.advantages, x.mask, kind="ppo",
                       eps_clip=0.2, weights=weights, scale=scale)  # fmt: skip


def sum_of_logprobs(x: LossInputs, weights, scale: LossScale):
    loss = -(x.advantages * x.logprobs * x.mask).sum() / scale.num_tokens
    return loss, {"custom/tokens": x.mask.sum()}


def test_a_custom_advantage_per_sample_or_per_token_is_used_as_the_estimators():
    scores = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.5, 0.2, 0.9, 0.1]])
    mask = (torch.rand(8, 5) > 0.3).float()
    hook = PolicyConfig(custom_advantage_path=f"{HERE}:grpo_by_hand")
    got, returns = compute_advantages(hook, scores, mask)
    want, _ = compute_advantages(PolicyConfig(), scores, mask)
    assert torch.equal(got, want) and returns is None
    per_token = PolicyConfig(custom_advantage_path=f"{HERE}:centred_per_token")
    got, _ = compute_advantages(per_token, scores, mask)
    assert torch.equal(got, compute_advantages(PolicyConfig(advantage_estimator="dr_grpo"),
                                                scores, mask)[0])  # fmt: skip
    with pytest.raises(ValueError, match=r"returned shape \(3,\); expected \[G, N\]"):
        compute_advantages(PolicyConfig(custom_advantage_path=f"{HERE}:wrong_shape"), scores, mask)


def test_a_custom_loss_replaces_the_surrogate_and_keeps_the_kl_and_metrics():
    torch.manual_seed(0)
    logp = torch.randn(4, 6, requires_grad=True)
    base = logp.detach()
    x = LossInputs(logprobs=logp, old_logprobs=base + 0.1, behaviour_logprobs=base,
                   advantages=torch.randn(4, 6), mask=torch.ones(4, 6),
                   ref_logprobs=base - 0.2)  # fmt: skip
    scale = LossScale.of(x.mask)
    kl = {"use_kl_loss": True, "kl_loss_coef": 0.1}
    built_in, m1 = rl_loss(PolicyConfig(**kl), x, scale)
    hooked, m2 = rl_loss(PolicyConfig(custom_loss_path=f"{HERE}:ppo_by_hand", **kl), x, scale)
    assert torch.allclose(built_in, hooked) and torch.allclose(m1["kl_loss"], m2["kl_loss"])
    _, m3 = rl_loss(PolicyConfig(custom_loss_path=f"{HERE}:sum_of_logprobs"), x, scale)
    assert m3["custom/tokens"] == 24 and "mismatch_kl" in m3


def test_the_trainer_steps_with_the_hooks_as_with_the_built_ins(tiny):  # noqa: F811
    hooks = PolicyConfig(custom_advantage_path=f"{HERE}:grpo_by_hand",
                         custom_loss_path=f"{HERE}:ppo_by_hand")  # fmt: skip
    a, b = TorchTrainer(config(tiny)), TorchTrainer(config(tiny), hooks)
    a.train_step(make_batch(4))
    b.train_step(make_batch(4))
    wa, wb = weights(a), weights(b)
    assert all(torch.allclose(wa[k], wb[k], atol=1e-7) for k in wa)


def test_hooks_that_cannot_work_are_refused_by_name():
    with pytest.raises(PluginError, match=r"custom loss path 'tests\.nope:fn'"):
        load_hooks(PolicyConfig(custom_loss_path="tests.nope:fn"))
    with pytest.raises(PluginError, match="not a function"):
        load_hooks(PolicyConfig(custom_advantage_path=f"{HERE}:HERE"))
    with pytest.raises(ValidationError, match="critic-free estimator"):
        PolicyConfig(advantage_estimator="ppo", custom_advantage_path=f"{HERE}:grpo_by_hand")
