"""rlbench-nb: notebook-first RL post-training of language models.

    import rlbench_nb as rl
    sess = rl.Session(rl.Config.load("configs/arith_grpo.yaml"))
    stats = sess.update(sess.prepare(sess.score(sess.rollout())))
"""
from .config import Config, ConfigError
from .data.batch import Batch
from .session import Session

__all__ = ["Batch", "Config", "ConfigError", "Session", "inspect"]


def inspect(source, tokenizer=None):
    """Rollout inspector for a Batch or a saved rollouts file (rollouts/step_N.jsonl)."""
    from .widgets.inspector import inspect as _inspect
    return _inspect(source, tokenizer)


def load_ipython_extension(ip):
    """`%load_ext rlbench_nb`: readable worker errors and the `%rl` magic."""
    from .ipython import load_ipython_extension as load
    load(ip)


def unload_ipython_extension(ip):
    from .ipython import unload_ipython_extension as unload
    unload(ip)
__version__ = "0.1.0"
