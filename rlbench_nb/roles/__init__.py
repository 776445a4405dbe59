"""Role workers as plain classes: the `local` backend calls them in-process, Ray wraps them in actors."""
from .critic import CriticWorker
from .policy import PolicyWorker, ReferenceWorker
from .reward import RewardWorker, load_reward_fn
from .rollout import HFRolloutWorker, VLLMRolloutWorker, rollout_worker_class
