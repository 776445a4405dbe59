"""Built-in offline tasks: everything needed to train with no download."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ...config import Config, ConfigError


@dataclass
class Task:
    name: str
    model_dir: Path          # tokenizer + (warm-started) model, loadable with from_pretrained
    train_rows: list[dict]
    test_rows: list[dict]
    verifier: Callable[..., float]
    reward_model_dir: Path | None = None  # reward.model.path: its folder ('task': the built-in one, built here)

    @property
    def max_positions(self) -> int | None:
        """The model's positions (max_position_embeddings): prompt + response must fit in them. Read from
        config.json where it names them there (AutoConfig imports the model family's modules: ~1.5 s of a
        controller's start, whose processes never load a model), else from AutoConfig."""
        try:
            named = json.loads((self.model_dir / "config.json").read_text()).get("max_position_embeddings")
        except (OSError, ValueError, AttributeError):
            named = None
        if isinstance(named, int):
            return named
        from transformers import AutoConfig
        return getattr(AutoConfig.from_pretrained(str(self.model_dir)), "max_position_embeddings", None)


def load_task(cfg: Config) -> Task:
    from ..models import model_folder
    from . import arithmetic
    from .warm_start import warm_started_model_dir

    rm = cfg.reward.model.path
    if rm == "task" and cfg.model.path:
        raise ConfigError("reward.model.path=task is trained on the built-in warm start's samples, not on "
                          f"model.path={cfg.model.path}'s: give your own reward model's folder")
    train, test = arithmetic.make_split(cfg.task)
    model_dir = model_folder(cfg.model.path) if cfg.model.path else warm_started_model_dir(cfg.task, cfg.model, train)
    if rm == "task":
        from .reward_model import task_reward_model_dir
        rm = task_reward_model_dir(cfg.task, cfg.model, model_dir, train, arithmetic.verify)
    return Task(cfg.task.name, model_dir, train, test, arithmetic.verify, Path(rm) if rm else None)
