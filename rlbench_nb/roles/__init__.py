"""Role workers as plain classes: the `local` backend calls them in-process, Ray wraps them in actors."""
from .critic import CriticWorker
from .policy import PolicyWorker, ReferenceWorker
from .reward import RewardWorker, load_reward_fn
from .reward_model import RewardModelWorker
from .rollout import HFRolloutWorker, VLLMRolloutWorker, rollout_worker_class


def role_specs(cfg, model_dir: str, eos_token_id: int, pad_token_id: int, reward_fn) -> dict[str, tuple[type, tuple]]:
    """role -> (worker class, constructor arguments) for this config, in build order (a role hosting
    another comes before it): policy, rollout, reward, then the reward model, reference (KL) and critic (GAE)
    when used."""
    specs = {"policy": (PolicyWorker, (cfg, model_dir)),
             "rollout": (rollout_worker_class(cfg.rollout.engine), (cfg, model_dir, eos_token_id, pad_token_id)),
             "reward": (RewardWorker, (reward_fn, cfg.reward, cfg.cluster.backend == "local"))}
    if cfg.reward.model.path:
        specs["reward_model"] = (RewardModelWorker, (cfg,))
    if cfg.uses_reference and not cfg.model.lora.r:  # with LoRA the policy, adapters off, is the reference
        specs["reference"] = (ReferenceWorker, (cfg, model_dir))
    if cfg.uses_critic:
        specs["critic"] = (CriticWorker, (cfg, model_dir))
    return specs
