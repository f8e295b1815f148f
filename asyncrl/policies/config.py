"""``PolicyConfig``: the algorithm section of a job (``algo`` in the config tree).

Flag names follow slime (``--advantage-estimator``, ``--eps-clip-high``, ...).
Combinations that train silently wrong are refused here, before any process starts. No
torch import: the CLI reads this module to build its flags.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

Estimator = Literal[
    "grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gspo", "cispo", "ppo"
]
Correction = Literal["none", "decoupled", "tis", "mis"]
KLKind = Literal["k1", "k2", "k3", "low_var_kl"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]


class PolicyConfig(BaseModel):
    """The RL objective: advantage estimator, surrogate loss, KL, entropy, corrections."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    advantage_estimator: Estimator = Field(
        "grpo", description="How samples are credited (--advantage-estimator)."
    )
    eps_clip: float = Field(0.2, gt=0, description="PPO clip range below 1 (--eps-clip).")
    eps_clip_high: float | None = Field(
        None,
        gt=0,
        description="Clip range above 1, clip-higher (--eps-clip-high); default eps_clip.",
    )
    eps_clip_c: float | None = Field(
        None, gt=1, description="Dual-clip constant for negative advantages (--eps-clip-c)."
    )
    loss_aggregation: Aggregation = Field(
        "token-mean", description="How token losses reduce to the step loss (--loss-aggregation)."
    )
    normalize_advantages: bool = Field(
        False,
        description="Whiten advantages over the batch's loss tokens (--normalize-advantages).",
    )
    max_response_len: int | None = Field(
        None, ge=1, description="L_max of seq-mean-token-sum-norm; default: longest in the step."
    )
    kl_coef: float = Field(
        0.0, ge=0, description="KL(pi||ref) as reward shaping, needs a reference model (--kl-coef)."
    )
    use_kl_loss: bool = Field(False, description="Add KL(pi||ref) to the loss (--use-kl-loss).")
    kl_loss_coef: float = Field(0.0, ge=0, description="Weight of the KL loss (--kl-loss-coef).")
    kl_loss_type: KLKind = Field("low_var_kl", description="KL estimator (--kl-loss-type).")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus weight (--entropy-coef).")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount of ppo/reinforce_pp (--gamma).")
    lambd: float = Field(1.0, ge=0, le=1, description="GAE lambda of ppo (--lambd).")
    value_clip: float | None = Field(0.2, gt=0, description="Critic value clip (--value-clip).")
    use_rollout_logprobs: bool = Field(
        False,
        description="Use the engine's behaviour log-probs as the old policy and skip the "
        "recompute forward pass (--use-rollout-logprobs).",
    )
    off_policy_correction: Correction = Field(
        "decoupled",
        description="Behaviour-policy correction: decoupled PPO, TIS, MIS or none "
        "(default decoupled; none with --use-rollout-logprobs).",
    )
    is_level: Literal["token", "sequence"] = Field(
        "token", description="Importance weights per token or per sequence (product)."
    )
    is_low: float = Field(0.0, ge=0, description="Lower bound of the IS weight (--tis-clip-low).")
    is_high: float = Field(2.0, gt=0, description="Upper bound of the IS weight (--tis-clip).")
    custom_advantage_path: str | None = Field(
        None,
        description="'module:fn' computing advantages in place of the estimator: "
        "fn(scores_GN, mask_BT, kl_BT) -> [G, N] per sample or [B, T] per token "
        "(docs/design.md, section 6)",
        json_schema_extra={"flag": "custom-advantage-function-path"},
    )
    custom_loss_path: str | None = Field(
        None,
        description="'module:fn' computing the policy-gradient term in place of the "
        "surrogate: fn(x: LossInputs, weights, scale: LossScale) -> (loss, metrics); KL and "
        "entropy terms are added as configured",
        json_schema_extra={"flag": "custom-loss-function-path"},
    )

    @model_validator(mode="before")
    @classmethod
    def _bypass_means_no_correction(cls, data: Any) -> Any:
        # --use-rollout-logprobs makes the behaviour policy the old policy: nothing to weigh.
        if isinstance(data, dict) and data.get("use_rollout_logprobs") is True:
            data = {"off_policy_correction": "none", **data}
        return data

    @model_validator(mode="after")
    def _coherent(self) -> PolicyConfig:
        if self.use_kl_loss and self.kl_loss_coef == 0:
            raise ValueError("use_kl_loss is set but kl_loss_coef is 0: set --kl-loss-coef > 0")
        if self.kl_coef > 0 and self.use_kl_loss:
            raise ValueError("kl_coef (KL in the reward) and use_kl_loss are mutually exclusive")
        if self.off_policy_correction != "none" and self.use_rollout_logprobs:
            raise ValueError(
                f"off_policy_correction={self.off_policy_correction} weighs the recomputed old "
                "policy against the behaviour log-probs; with --use-rollout-logprobs they are "
                "the same and every weight is 1: drop one of the two"
            )
        if self.is_low >= self.is_high:
            raise ValueError(f"is_low ({self.is_low}) must be < is_high ({self.is_high})")
        if self.custom_advantage_path and self.advantage_estimator == "ppo":
            raise ValueError(
                "custom_advantage_path replaces the estimator, and ppo's critic learns from "
                "the returns its GAE gives: use a critic-free estimator with it"
            )
        if self.advantage_estimator == "reinforce_pp" and not self.normalize_advantages:
            raise ValueError("reinforce_pp needs --normalize-advantages (its returns are unscaled)")
        return self

    @property
    def loss_kind(self) -> str:
        """The surrogate: ``gspo`` and ``cispo`` have their own, everything else is PPO's."""
        return self.advantage_estimator if self.advantage_estimator in ("gspo", "cispo") else "ppo"

    @property
    def needs_ref(self) -> bool:
        """A reference model is loaded when KL enters the reward or the loss."""
        return self.kl_coef > 0 or self.use_kl_loss

    @property
    def needs_critic(self) -> bool:
        """Only PPO with GAE learns a value function."""
        return self.advantage_estimator == "ppo"

    @property
    def recompute_old_logprobs(self) -> bool:
        """Whether the trainer runs a no-grad forward for the old (proximal) log-probs."""
        return not self.use_rollout_logprobs

    def check_async(self, max_staleness: int) -> None:
        """Refuse off-policy training whose PPO clip would silently do nothing.

        With ``eta > 0`` a sample may come from older weights. If the old log-probs are
        recomputed by the trainer and nothing relates them to the behaviour policy, the
        ratio starts at 1 for every token and the trust region no longer bounds the update
        against the policy that generated the data.
        """
        uncorrected = self.off_policy_correction == "none" and not self.use_rollout_logprobs
        if max_staleness > 0 and uncorrected:
            raise ValueError(
                f"async training (max_staleness={max_staleness}) with recomputed old log-probs "
                "and no off-policy correction: PPO clipping would not bound the update against "
                "the behaviour policy. Set --off-policy-correction decoupled (or tis / mis), "
                "or --use-rollout-logprobs, or --buffer.max-staleness 0 for synchronous training"
            )
