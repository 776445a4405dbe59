"""RL math as pure tensor functions: advantages, losses, KL. No Ray, no I/O."""
from .advantages import (
                         ADVANTAGES,
                         compute_advantages,
                         gae_advantages,
                         grpo_advantages,
                         outcome_token_rewards,
                         reinforce_pp_advantages,
                         rloo_advantages,
                         sequence_advantage,
)
from .kl import AdaptiveKLController, FixedKLController, apply_kl_penalty, kl_penalty, make_kl_controller, reference_kl
from .losses import POLICY_LOSSES, agg_loss, entropy_from_logits, policy_loss, ppo_policy_loss, value_loss
from .masked import masked_mean, masked_var, masked_whiten
from .mismatch import mismatch_metrics, rollout_is_weights
