"""Closed-form checks of asyncrl.policies.

Every expected number is worked out by hand from the formula in a comment next to it,
never taken from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
from pydantic import ValidationError

from asyncrl.policies import (
    LossInputs,
    LossScale,
    PolicyConfig,
    aggregate,
    approx_kl,
    compute_advantages,
    discounted_returns,
    gae,
    group_advantages,
    importance_weights,
    pass_at_k,
    policy_loss,
    rl_loss,
    sft_loss,
    value_loss,
)


def t(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def close(a: torch.Tensor | float, b: torch.Tensor | list | float, atol: float = 1e-5) -> bool:
    return torch.allclose(torch.as_tensor(a).float(), torch.as_tensor(b).float(), atol=atol)


# ----------------------------------------------------------------------------- advantages


def test_grpo_divides_the_centred_reward_by_the_bessel_std():
    # mean 0.5; deviations +-0.5; var = 4 * 0.25 / 3 = 1/3; A = 0.5 / sqrt(1/3) = 0.8660254
    a = group_advantages(t([1, 0, 0, 1]), "grpo")
    assert close(a, [[0.8660254, -0.8660254, -0.8660254, 0.8660254]])
    assert close(group_advantages(t([1, 0, 0, 1]), "gspo"), a)
    assert close(group_advantages(t([1, 0, 0, 1]), "cispo"), a)


def test_dr_grpo_only_subtracts_the_group_mean():
    assert close(
        group_advantages(t([1, 0, 0, 1], [2, 2, 2, 6]), "dr_grpo"),
        t([0.5, -0.5, -0.5, 0.5], [-1, -1, -1, 3]),
    )


def test_rloo_uses_the_mean_of_the_other_samples():
    # A_1 = 1 - (2 + 3) / 2 = -1.5; A_2 = 2 - (1 + 3) / 2 = 0; A_3 = 3 - (1 + 2) / 2 = 1.5
    assert close(group_advantages(t([1, 2, 3]), "rloo"), [[-1.5, 0.0, 1.5]])
    with pytest.raises(ValueError, match="at least 2"):
        group_advantages(t([1]), "rloo")


def test_reinforce_pp_baseline_whitens_the_centred_rewards_over_the_batch():
    # centred [[-1, 1], [0, 0]]; batch mean 0; std (Bessel) = sqrt(2 / 3) = 0.8164966
    a = group_advantages(t([1, 3], [5, 5]), "reinforce_pp_baseline")
    assert close(a, [[-1.2247449, 1.2247449], [0.0, 0.0]])


def test_a_group_of_one_or_of_equal_rewards_gets_no_advantage():
    assert close(group_advantages(t([3.0]), "grpo"), [[0.0]])
    assert close(group_advantages(t([1, 1, 1]), "grpo"), [[0.0, 0.0, 0.0]])


def test_token_level_estimators_are_refused_by_group_advantages():
    with pytest.raises(ValueError, match="ppo and reinforce_pp are token-level"):
        group_advantages(t([1, 0]), "ppo")
    with pytest.raises(ValueError, match=r"\[groups, group_size\]"):
        group_advantages(torch.ones(4), "grpo")


def test_gae_with_gamma_and_lambda_one_is_return_minus_value():
    # Every A_t = sum of future rewards - V_t = 1 - V_t; returns are all 1.
    adv, ret = gae(t([0, 0, 1]), t([0.5, 0.6, 0.7]), t([1, 1, 1]), 1.0, 1.0)
    assert close(adv, [[0.5, 0.4, 0.3]]) and close(ret, [[1.0, 1.0, 1.0]])


def test_gae_recursion_by_hand():
    # t=2: delta = 1 - 0.7 = 0.3, A = 0.3
    # t=1: delta = 0.9 * 0.7 - 0.6 = 0.03, A = 0.03 + 0.45 * 0.3 = 0.165
    # t=0: delta = 0.9 * 0.6 - 0.5 = 0.04, A = 0.04 + 0.45 * 0.165 = 0.11425
    adv, ret = gae(t([0, 0, 1]), t([0.5, 0.6, 0.7]), t([1, 1, 1]), 0.9, 0.5)
    assert close(adv, [[0.11425, 0.165, 0.3]])
    assert close(ret, [[0.61425, 0.765, 1.0]])


def test_gae_skips_masked_tokens_such_as_tool_output_and_padding():
    # The masked middle token's reward 5 and value 99 are ignored:
    # t=2: A = 1 - 0.7 = 0.3; t=0: delta = 0 + 0.7 - 0.5 = 0.2, A = 0.2 + 0.3 = 0.5
    adv, ret = gae(t([0, 5, 1, 9]), t([0.5, 99, 0.7, 9]), t([1, 0, 1, 0]), 1.0, 1.0)
    assert close(adv, [[0.5, 0.0, 0.3, 0.0]]) and close(ret, [[1.0, 0.0, 1.0, 0.0]])


def test_discounted_returns_by_hand():
    # G2 = 2; G1 = 0 + 0.5 * 2 = 1; G0 = 1 + 0.5 * 1 = 1.5; padding reward 7 is ignored.
    assert close(discounted_returns(t([1, 0, 2]), t([1, 1, 1]), 0.5), [[1.5, 1.0, 2.0]])
    assert close(discounted_returns(t([1, 0, 7]), t([1, 1, 0]), 0.5), [[1.0, 0.0, 0.0]])


# ----------------------------------------------------------------------------- KL


def test_kl_estimators_by_hand():
    # d = log 0.5 - log 0.25 = ln 2 = 0.6931472
    lp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    assert close(approx_kl(lp, ref, "k1"), [0.6931472])
    assert close(approx_kl(lp, ref, "k2"), [0.5 * 0.6931472**2])  # 0.2402265
    assert close(approx_kl(lp, ref, "k3"), [0.5 - 1 + 0.6931472])  # exp(-d) - 1 + d
    assert close(approx_kl(lp, ref, "low_var_kl"), [0.1931472])


def test_low_var_kl_is_clamped_to_ten():
    # d = 30 -> clamped to 20: exp(-20) - 1 + 20 = 19.0 -> 10; d = -30 -> exp(20) huge -> 10
    lp = torch.tensor([30.0, -30.0])
    assert close(approx_kl(lp, torch.zeros(2), "low_var_kl"), [10.0, 10.0])
    assert approx_kl(lp, torch.zeros(2), "k3")[1] > 1e12
    with pytest.raises(ValueError, match="k1, k2, k3, low_var_kl"):
        approx_kl(lp, lp, "k4")


# ----------------------------------------------------------------------------- aggregation


LOSS = t([1, 2, 3], [4, 0, 0])
MASK = t([1, 1, 1], [1, 0, 0])


def test_aggregations_by_hand():
    assert close(aggregate(LOSS, MASK, "token-mean"), 10 / 4)
    assert close(aggregate(LOSS, MASK, "seq-mean-token-mean"), (6 / 3 + 4 / 1) / 2)
    scale = LossScale(num_tokens=4, num_seqs=2, max_len=4)
    assert close(aggregate(LOSS, MASK, "seq-mean-token-sum-norm", scale), 10 / (4 * 2))
    with pytest.raises(ValueError, match="token-mean"):
        aggregate(LOSS, MASK, "mean")


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batch_shares_under_the_step_scale_sum_to_the_whole(mode):
    scale = LossScale.of(MASK, max_len=5)
    parts = aggregate(LOSS[:1], MASK[:1], mode, scale) + aggregate(LOSS[1:], MASK[1:], mode, scale)
    assert close(parts, aggregate(LOSS, MASK, mode, scale))


def test_sft_loss_is_the_mean_negative_log_likelihood_of_masked_tokens():
    assert close(sft_loss(t([-1.0, -3.0, -100.0]), t([1, 1, 0])), 2.0)


# ----------------------------------------------------------------------------- PPO


def ppo_case(ratios: list[float], advantages: list[float]):
    old = torch.zeros(1, len(ratios))
    lp = torch.log(torch.tensor([ratios])).requires_grad_(True)
    return lp, old, torch.tensor([advantages]), torch.ones(1, len(ratios))


def test_ppo_clip_by_hand_and_clipped_tokens_have_zero_gradient():
    # token 0: r=1.5, A=+1: max(-1.5, -1.2) = -1.2 (clipped)
    # token 1: r=0.5, A=+1: max(-0.5, -0.8) = -0.5 (not clipped)
    # token 2: r=0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped)
    # token 3: r=1.1, A=-1: max(1.1, 1.1) = 1.1 (inside the range)
    lp, old, adv, mask = ppo_case([1.5, 0.5, 0.5, 1.1], [1, 1, -1, -1])
    loss, m = policy_loss(lp, old, adv, mask, eps_clip=0.2)
    assert close(loss, (-1.2 - 0.5 + 0.8 + 1.1) / 4)
    assert close(m["clip_frac"], 0.5)
    loss.backward()
    # d(-A r)/d logp = -A r / 4 for unclipped tokens
    assert close(lp.grad, [[0.0, -0.5 / 4, 0.0, 1.1 / 4]])


def test_clip_higher_widens_only_the_upper_bound():
    # r=1.25, A=+1: eps_high 0.28 keeps -1.25; eps_high 0.2 clips to -1.2
    lp, old, adv, mask = ppo_case([1.25], [1])
    assert close(policy_loss(lp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28)[0], -1.25)
    assert close(policy_loss(lp, old, adv, mask, eps_clip=0.2)[0], -1.2)
    # r=0.75, A=-1 is below 1 - 0.2: clipped to 0.8 whatever eps_high
    lp, old, adv, mask = ppo_case([0.75], [-1])
    assert close(policy_loss(lp, old, adv, mask, eps_clip=0.2, eps_clip_high=0.28)[0], 0.8)


def test_dual_clip_caps_the_loss_of_negative_advantages_at_c_times_minus_a():
    # r=3, A=-1: PPO max(3, 1.2) = 3; dual clip c=2 -> min(3, 2) = 2 and no gradient
    # r=3, A=+1: unaffected: max(-3, -1.2) = -1.2
    lp, old, adv, mask = ppo_case([3.0, 3.0], [-1, 1])
    loss, m = policy_loss(lp, old, adv, mask, eps_clip=0.2, dual_clip=2.0)
    assert close(loss, (2.0 - 1.2) / 2) and close(m["dual_clip_frac"], 0.5)
    loss.backward()
    assert close(lp.grad, [[0.0, 0.0]])
    with pytest.raises(ValueError, match="> 1"):
        policy_loss(lp, old, adv, mask, dual_clip=0.5)


def test_importance_weights_multiply_the_token_losses():
    lp, old, adv, mask = ppo_case([1.0, 1.0], [1, 1])
    loss, _ = policy_loss(lp, old, adv, mask, weights=torch.tensor([[0.5, 0.0]]))
    assert close(loss, (-0.5 + 0.0) / 2)


def test_cispo_weights_log_probs_by_the_stopped_clipped_ratio():
    # r = 2 clipped to 1 + 0.5 = 1.5; r = 1.2 inside. A = 1.
    # loss = (-1.5 * lp0 - 1.2 * lp1) / 2 with lp = log r (old = 0)
    lp, old, adv, mask = ppo_case([2.0, 1.2], [1, 1])
    loss, m = policy_loss(lp, old, adv, mask, kind="cispo", eps_clip=1.0, eps_clip_high=0.5)
    assert close(loss, (-1.5 * math.log(2.0) - 1.2 * math.log(1.2)) / 2)
    assert close(m["clip_frac"], 0.5)
    loss.backward()
    # Gradient only through logp: -sg(clip(r)) * A / 2, even for the clipped token.
    assert close(lp.grad, [[-1.5 / 2, -1.2 / 2]])


def test_gspo_uses_the_sequence_ratio_and_drops_clipped_sequences():
    # seq 0: log-ratios (0.1, -0.1), mean 0 -> s = 1, A = 1: token losses -1, -1
    # seq 1: log-ratios (0.5, 0.5) -> s = e^0.5 = 1.6487 > 1.2, A = 1: clipped to -1.2
    lp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9], [-1.5, -1.5]])
    adv, mask = torch.ones(2, 2), torch.ones(2, 2)
    loss, m = policy_loss(lp, old, adv, mask, kind="gspo", aggregation="seq-mean-token-mean")
    assert close(loss, (-1.0 + -1.2) / 2) and close(m["clip_frac"], 0.5)
    loss.backward()
    # grad of token t of seq 0 = -A * s / len / num_seqs = -1 / 2 / 2
    assert close(lp.grad, [[-0.25, -0.25], [0.0, 0.0]])


def test_value_loss_takes_the_larger_of_clipped_and_unclipped_errors():
    # v=1, old=0.5, R=2: err 1; v_clip = 0.7, err_clip = 1.69 -> 0.5 * 1.69
    loss, m = value_loss(t([1.0]), t([0.5]), t([2.0]), t([1.0]), clip=0.2)
    assert close(loss, 0.845) and close(m["value_clip_frac"], 1.0)
    assert close(value_loss(t([1.0]), t([0.5]), t([2.0]), t([1.0]), clip=None)[0], 0.5)


# ----------------------------------------------------------------------------- corrections


def test_truncated_and_masked_importance_weights_by_hand():
    # w = 0.6 / 0.2 = 3 and 0.1 / 0.2 = 0.5
    prox = torch.log(t([0.6, 0.1]))
    behav = torch.log(t([0.2, 0.2]))
    mask = t([1, 1])
    w, m = importance_weights(prox, behav, mask, mode="truncate", high=2.0)
    assert close(w, [[2.0, 0.5]]) and close(m["is_clipped_frac"], 0.5)
    w, _ = importance_weights(prox, behav, mask, mode="mask", low=0.6, high=2.0)
    assert close(w, [[0.0, 0.0]])
    # sequence level: the product 3 * 0.5 = 1.5 applies to both tokens
    w, _ = importance_weights(prox, behav, mask, mode="mask", level="sequence", high=2.0)
    assert close(w, [[1.5, 1.5]])


def test_decoupled_ppo_drops_tokens_whose_behaviour_weight_exceeds_the_cap():
    cfg = PolicyConfig(off_policy_correction="decoupled", is_high=2.0)
    lp = torch.zeros(1, 2, requires_grad=True)
    x = LossInputs(
        logprobs=lp,
        old_logprobs=torch.zeros(1, 2),
        behaviour_logprobs=torch.log(t([0.25, 0.8])),  # w = 1 / 0.25 = 4 and 1 / 0.8 = 1.25
        advantages=torch.ones(1, 2),
        mask=torch.ones(1, 2),
    )
    loss, m = rl_loss(cfg, x, LossScale.of(x.mask))
    # token 0 dropped (w = 4 > 2); token 1: -A * r * w = -1.25, over 2 tokens
    assert close(loss, -1.25 / 2)
    loss.backward()
    assert close(lp.grad, [[0.0, -1.25 / 2]])
    assert close(m["is_clipped_frac"], 0.5)


# ----------------------------------------------------------------------------- objective


def test_grpo_kl_shaping_lowers_the_score_by_the_sequence_kl():
    cfg = PolicyConfig(kl_coef=1.0)
    mask = t([1, 1], [1, 1])
    kl = t([0.5, 0.5], [0.0, 0.0])
    # shaped scores: 1 - 1 * (0.5 + 0.5) = 0 and 0 - 0 = 0: equal, so no advantage
    adv, ret = compute_advantages(cfg, t([1.0, 0.0]), mask, kl_BT=kl)
    assert close(adv, torch.zeros(2, 2)) and ret is None
    adv, _ = compute_advantages(PolicyConfig(), t([1.0, 0.0]), mask)
    assert close(adv, [[0.7071068, 0.7071068], [-0.7071068, -0.7071068]])
    with pytest.raises(ValueError, match="kl_BT"):
        compute_advantages(cfg, t([1.0, 0.0]), mask)


def test_reinforce_pp_whitens_discounted_returns():
    # seq 0 (2 tokens): rewards (0, 1), returns (1, 1); seq 1 (1 token): reward 0.
    # tokens (1, 1, 0): mean 2/3, var 2/9 -> (0.7071, 0.7071, -1.4142)
    cfg = PolicyConfig(advantage_estimator="reinforce_pp", normalize_advantages=True)
    adv, _ = compute_advantages(cfg, t([1.0, 0.0]), t([1, 1], [1, 0]))
    assert close(adv, [[0.7071068, 0.7071068], [-1.4142135, 0.0]], atol=1e-4)


def test_ppo_estimator_gives_gae_advantages_and_returns():
    cfg = PolicyConfig(advantage_estimator="ppo")
    values = t([0.5, 0.6, 0.7])
    adv, ret = compute_advantages(cfg, t([1.0]), t([1, 1, 1]), values_BT=values)
    assert close(adv, [[0.5, 0.4, 0.3]]) and close(ret, [[1.0, 1.0, 1.0]])
    with pytest.raises(ValueError, match="values"):
        compute_advantages(cfg, t([1.0]), t([1, 1, 1]))


def test_rl_loss_adds_kl_loss_and_entropy_bonus():
    cfg = PolicyConfig(use_kl_loss=True, kl_loss_coef=0.5, kl_loss_type="k1", entropy_coef=0.1)
    x = LossInputs(
        logprobs=torch.zeros(1, 2),
        old_logprobs=torch.zeros(1, 2),
        behaviour_logprobs=torch.zeros(1, 2),
        advantages=t([1.0, -1.0]),
        mask=torch.ones(1, 2),
        entropy=t([2.0, 4.0]),
        ref_logprobs=t([-1.0, -1.0]),
    )
    loss, m = rl_loss(cfg, x, LossScale.of(x.mask))
    # pg: (-1 + 1) / 2 = 0; kl k1 = mean(0 - (-1)) = 1 -> 0.5; entropy mean 3 -> -0.3
    assert close(loss, 0.5 - 0.3) and close(m["kl_loss"], 1.0) and close(m["entropy"], 3.0)


# ----------------------------------------------------------------------------- config


def test_async_ppo_without_a_correction_is_refused_with_the_flag_to_set():
    with pytest.raises(ValueError, match="--off-policy-correction decoupled"):
        PolicyConfig(off_policy_correction="none").check_async(max_staleness=2)
    PolicyConfig(off_policy_correction="none").check_async(max_staleness=0)
    PolicyConfig().check_async(max_staleness=2)
    assert PolicyConfig(use_rollout_logprobs=True).off_policy_correction == "none"
    PolicyConfig(off_policy_correction="decoupled").check_async(max_staleness=2)
    PolicyConfig(use_rollout_logprobs=True).check_async(max_staleness=2)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"use_kl_loss": True}, "kl-loss-coef"),
        ({"kl_coef": 0.1, "use_kl_loss": True, "kl_loss_coef": 0.1}, "mutually exclusive"),
        ({"off_policy_correction": "tis", "use_rollout_logprobs": True}, "every weight is 1"),
        ({"advantage_estimator": "reinforce_pp"}, "normalize-advantages"),
        ({"is_low": 3.0, "is_high": 2.0}, "is_low"),
        ({"advantage_estimator": "grpo2"}, "advantage_estimator"),
        ({"eps_clip_c": 0.9}, "eps_clip_c"),
    ],
)
def test_incoherent_policy_configs_are_refused(fields, match):
    with pytest.raises(ValidationError, match=match):
        PolicyConfig(**fields)


def test_config_properties():
    assert PolicyConfig(advantage_estimator="gspo").loss_kind == "gspo"
    assert PolicyConfig(advantage_estimator="rloo").loss_kind == "ppo"
    assert PolicyConfig(advantage_estimator="ppo").needs_critic
    assert PolicyConfig(kl_coef=0.1).needs_ref and not PolicyConfig().needs_ref


# ----------------------------------------------------------------------------- pass@k


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2) / C(5,2)
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(5, 0, 3) == 0.0
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(3, 4, 1)


def test_every_public_name_resolves_and_the_config_needs_no_torch():
    import subprocess
    import sys

    import asyncrl.policies as policies

    assert sorted(policies._MODULE_OF) == sorted(policies.__all__)
    assert all(callable(getattr(policies, name)) for name in policies.__all__)
    code = (
        "import sys; from asyncrl.policies import PolicyConfig; PolicyConfig(); "
        "assert 'torch' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_job_config_refuses_async_ppo_without_correction_before_anything_starts():
    from asyncrl.config import ConfigError, load_config

    flags = ["--buffer.max-staleness", "2", "--off-policy-correction", "none"]
    with pytest.raises(ConfigError, match="--off-policy-correction decoupled"):
        load_config(overrides=flags)
    config = load_config(overrides=[*flags[:2], "--eps-clip-high", "0.28", "--tis-clip", "3"])
    assert config.algo.eps_clip_high == 0.28 and config.algo.is_high == 3.0
    assert config.algo.off_policy_correction == "decoupled"
