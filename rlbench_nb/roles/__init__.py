"""Role workers as plain classes: the `local` backend calls them in-process, Ray wraps them in actors."""
from .critic import CriticWorker
from .policy import PolicyWorker, ReferenceWorker
from .reward import RewardWorker, load_reward_fn
from .reward_model import RewardModelWorker
from .rollout import HFRolloutWorker, VLLMRolloutWorker, rollout_worker_class


def role_specs(cfg, model_dir: str, eos_token_id: int, pad_token_id: int, reward_fn,
               reward_model_dir: str | None = None, *, in_process: bool) -> dict[str, tuple[type, tuple]]:
    """role -> (worker class, constructor arguments) for each of `cfg.roles`, in its build order;
    `in_process`: the workers are plain objects in the controller's process (cluster.in_process)."""
    specs = {"policy": (PolicyWorker, (cfg, model_dir)),
             "rollout": (rollout_worker_class(cfg.rollout.engine), (cfg, model_dir, eos_token_id, pad_token_id)),
             "reward": (RewardWorker, (reward_fn, cfg.reward, in_process)),
             "reward_model": (RewardModelWorker, (cfg, reward_model_dir)),
             "reference": (ReferenceWorker, (cfg, model_dir)),
             "critic": (CriticWorker, (cfg, model_dir))}
    return {role: specs[role] for role in cfg.roles}
