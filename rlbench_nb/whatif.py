"""The research loop's doors on `Session`: methods written here and bound there (`snapshot =
whatif.snapshot`), so session.py stays the phases. Rewards, environments and RL functions from a cell,
settings changed on the live session, snapshots (snapshots.py), branches, forks, replays and comparisons
(branches.py, widgets/comparison.py).

    @sess.policy_loss
    def reinforce(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, *, cfg): ...
    b = sess.fork("reinforce", 20, "algo.policy_loss=reinforce")
    sess.compare(b, sess.fork("ppo", 20))
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from .algos import make_kl_controller
from .config import Config
from .errors import UsageError

if TYPE_CHECKING:
    from .data.batch import Batch
    from .session import Session


def set_reward(self: Session, fn: Callable[..., float]) -> Callable[..., float]:
    """Replace the reward function on every reward worker; `score(batch)` re-scores with it.

    The function must survive pickling (cloudpickle, as Ray ships it), under every backend, so a
    notebook that works locally works on a cluster."""
    from .algos.custom import shippable
    shippable(fn, "reward function", "reward workers")
    with self._phase("set_reward"):
        self.workers.set_reward(fn)
    return fn


def set_env(self: Session, env_cls) -> type:
    """Run each rollout as a multi-turn episode with `env_cls` (an rlbench_nb.envs.Env subclass, e.g. one
    written in a cell); None: back to single responses. Usable as a decorator: @sess.set_env."""
    from .algos.custom import shippable
    from .envs import check_env
    if env_cls is not None:
        check_env(env_cls, "set_env's argument")
        shippable(env_cls, "environment class", "rollout workers")
        if self.cfg.algo.advantage not in ("grpo", "rloo") or self.cfg.run.deterministic:
            raise UsageError("environments run with grpo or rloo, without run.deterministic, "
                             f"for now (this session: algo.advantage={self.cfg.algo.advantage}, "
                             f"run.deterministic={self.cfg.run.deterministic})")
    with self._phase("set_env"):
        self._env_cls = env_cls
    return env_cls


def advantage(self: Session, fn: Callable) -> Callable:
    """Register an advantage estimator under its function's name (a decorator: `@sess.advantage`);
    `algo.advantage=<name>` then uses it (in `configure`, a branch, or a config loaded afterwards).

    Signature: `fn(rewards_BR, mask_BR, *, group_ids, values_BR=None, cfg) -> (advantages_BR,
    returns_BR or None)`, `cfg` being the AlgoConfig. It runs in the controller (in `prepare`). It is
    tried on a two-sample batch first: one that fails is refused with the reason."""
    from .algos.advantages import ADVANTAGES
    from .algos.custom import check_advantage
    check_advantage(fn, self.cfg.algo)
    ADVANTAGES[fn.__name__] = fn
    return fn


def policy_loss(self: Session, fn: Callable) -> Callable:
    """Register a per-token policy loss under its function's name (a decorator: `@sess.policy_loss`) and
    ship it to every policy worker; `algo.policy_loss=<name>` then uses it.

    Signature: `fn(logprobs_BR, old_logprobs_BR, advantages_BR, mask_BR, *, cfg) -> loss_BR` or
    `(loss_BR, {stat: float})`; the worker aggregates loss_BR with `algo.loss_agg`. It is tried on a
    two-sample batch and must survive pickling (Ray ships it): either failing is refused with the reason."""
    from .algos.custom import check_policy_loss, shippable
    from .algos.losses import POLICY_LOSSES
    check_policy_loss(fn, self.cfg.algo)
    shippable(fn, "policy loss", "policy workers")
    with self._phase("policy_loss"):
        POLICY_LOSSES[fn.__name__] = fn
        self.workers.register_policy_loss(fn.__name__, fn)
    return fn


def configure(self: Session, *overrides: str) -> Config:
    """Change settings of the main line from here on (`"train.lr=1e-4"`, `"algo.advantage=my_fn"`): the
    same changes a branch may make (branches.variant); written to the run's config.yaml."""
    from .branches import variant
    cfg = variant(self.cfg, overrides, "sess.configure")
    with self._phase("configure"):
        self.apply_config(cfg)
        self.rundir.write_config(cfg)
    return cfg


def apply_config(self: Session, cfg: Config) -> None:
    """Every worker and the controller's own parts onto `cfg`, a config already checked against this one
    (shapes and roles unchanged: branches.variant). `configure` is the door from a cell; branches and
    restores come here."""
    old, self.cfg = self.cfg, cfg
    self.workers.set_config(cfg)
    self.progress.sampler.batch_size = cfg.data.batch_size
    kl = ("kl_coef", "kl_ctrl", "target_kl", "kl_horizon")
    if any(getattr(old.algo, k) != getattr(cfg.algo, k) for k in kl):
        self.progress.kl = make_kl_controller(cfg.algo)


def snapshot(self: Session, to_disk: bool = False):
    """Everything a step depends on, kept in the workers' memory (or in RUN_DIR/snapshots with
    `to_disk=True`): `sess.restore(snap)` comes back to exactly this point."""
    from . import snapshots
    with self._phase("snapshot"):
        return snapshots.take(self, to_disk)


def restore(self: Session, snap) -> Session:
    """Back to a snapshot: weights, optimizer state, RNG, data position, KL controller, step, config and
    reward function. Metric rows written since move to metrics.superseded.jsonl."""
    from . import snapshots
    with self._phase("restore", changes_state=True, repairs=True):
        snapshots.restore(self, snap)
    return self


def branch(self: Session, name: str, *overrides: str, reward: Callable | None = None):
    """`with sess.branch("clip-0.28", "algo.clip_high=0.28") as b: b.run(20)`: a variant from this point,
    then back to the main line exactly as it was (branches.py)."""
    from .branches import branch
    return branch(self, name, overrides, reward)


def fork(self: Session, name: str, steps: int, *overrides: str, reward: Callable | None = None,
         progress: bool = True):
    """`steps` steps of a variant from here, then back: returns the Branch (its rows, evaluations, end state)."""
    from .branches import fork
    return fork(self, name, steps, overrides, reward, progress)


def adopt(self: Session, branch) -> Session:
    """Continue the main line from the end of a branch (its weights, optimizer, data position, settings)."""
    from .branches import adopt
    with self._phase("adopt", changes_state=True, repairs=True):
        adopt(self, branch)
    return self


def replay(self: Session, batch: Batch, *overrides: str, name: str = "replay"):
    """prepare + update on a batch that already exists (a variable, or `rl.load_rollouts(file)`), with
    `overrides`, on a branch: the update's metrics and each parameter's relative weight change; the
    session comes back untouched."""
    from .branches import replay
    return replay(self, batch, overrides, name)


def compare(self: Session, *runs, metrics: list[str] | None = None, last: int = 5):
    """Branches and replays side by side: a table of each metric (mean of the `last` steps) and its
    difference from the first, and their curves overlaid (`.figure()`)."""
    from .widgets.comparison import Comparison
    return Comparison(list(runs), metrics=metrics, last=last)


def doctor(self: Session, rows: int = 4):
    """Certify this session before a long run: one line per check (the engine's log-probs against the
    trainer's, an update at learning rate 0, the samples, the reward, settings that do nothing), each failed
    one with its number, likely cause and fix. The session is left as it was (doctor.py)."""
    from .doctor import examine
    self.guard.check("run the doctor")  # closed, needing resync or stepped by a background run: said first
    return examine(self, rows)
