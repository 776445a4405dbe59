"""rlbench-nb: notebook-first RL post-training of language models.

    import rlbench_nb as rl
    sess = rl.Session(rl.Config.load("configs/arith_grpo.yaml"))
    stats = sess.update(sess.prepare(sess.score(sess.rollout())))
"""
from .config import Config, ConfigError
from .data.batch import Batch
from .session import Session

__all__ = ["Batch", "Config", "ConfigError", "Session"]
__version__ = "0.1.0"
