"""Where a run is: its step, its data position, its KL controller, each trainer's optimizer steps, its last
save and how its last run() ended. The Session holds one `Progress` and nothing else writes these; its
`state_dict()` is the controller's share of every checkpoint, snapshot and controller_state.json (what
`Session.attach` reads back after a controller died).

    progress = Progress.start(cfg, len(train_data))
    progress.commit(kl_current, n_samples)   # a step was taken: the count and the KL controller move together
    progress.load_state_dict(checkpoint_state)  # every way back (checkpoint, snapshot, branch end, attach)
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass, field

from .algos import make_kl_controller
from .data.datasets import PromptSampler

log = logging.getLogger(__name__)


@dataclass
class Progress:
    sampler: PromptSampler  # the data position: which training prompts come next
    kl: object              # algos.kl's controller: the KL coefficient, moved once per committed step
    step: int = 0
    trainer_steps: dict[str, int] = field(default_factory=dict)  # role -> its optimizer's steps at `step`
    last_saved_step: int | None = None  # the step of this session's newest checkpoint
    run_target: int | None = None       # the step the current (or last) run() goes to
    # how the last run() ended (finished, stopped, failed) and at which step; cleared by a step or a way back
    run_outcome: str | None = None
    run_end_step: int | None = None

    @classmethod
    def start(cls, cfg, n_train: int) -> Progress:
        """Step 0 of a run over `n_train` training rows."""
        sampler = PromptSampler(n_train, cfg.data.batch_size, cfg.run.seed, cfg.data.shuffle)
        return cls(sampler, make_kl_controller(cfg.algo))

    def commit(self, kl_current: float | None, n_samples: int) -> int:
        """A step was taken (its update applied): the count moves, and the KL controller with the KL the
        step measured. Returns the new step."""
        self.step += 1
        self.run_outcome = None  # moved on from the last run's end (a run sets it again when it ends)
        if kl_current is not None:
            self.kl.update(kl_current, n_steps=n_samples)
        return self.step

    @contextmanager
    def committing(self, kl_current: float | None, n_samples: int):
        """`commit` for the block that writes its record: undone if the block raises (a read-only or full run
        directory), so the count stays where the files say."""
        before = self.state_dict()
        self.commit(kl_current, n_samples)
        try:
            yield
        except BaseException:
            self.load_state_dict(before)
            raise

    def state_dict(self) -> dict:
        return {"step": self.step, "sampler": self.sampler.state_dict(), "kl_ctrl": self.kl.state_dict(),
                "trainer_steps": dict(self.trainer_steps)}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.run_outcome = None  # another state than the one the last run ended in
        self.trainer_steps = dict(state.get("trainer_steps", {}))  # absent in runs from before it was kept
        self.sampler.load_state_dict(state["sampler"])
        self.kl.load_state_dict(state["kl_ctrl"])

    def trainers_ahead(self, workers) -> bool:
        """Attached: are the trainers past where the last committed step left them? A controller killed
        during an update (or between it and its commit) leaves them so; the session then needs `resync()`."""
        ahead = workers.trainers_past(self.trainer_steps)
        if ahead:
            role, held = ahead
            log.warning("the %s has taken %d optimizer steps, but this run's last committed step (%d) left it at "
                        "%d: its controller was killed during step %d's update. Call sess.resync() to return every "
                        "role to the latest checkpoint", role, held, self.step, self.trainer_steps[role],
                        self.step + 1)
        return bool(ahead)
