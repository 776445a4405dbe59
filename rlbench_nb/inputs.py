"""What a session reads before it starts anything: the task, its tokenizer and prompt codec, the train and
test prompts, the reward function and the environment class — each checked here, before the run directory
is claimed or a worker starts, so a wrong path or setting costs nothing.

    inputs = load_inputs(cfg)            # ConfigError / DataError naming what to fix
    inputs.prompts.encode(inputs.train_data.rows[:4], n=2)
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .config import Config, ConfigError
from .data.datasets import PromptDataset, read_rows, validate_rows
from .data.tasks import load_task
from .envs import load_env
from .prompts import PromptCodec, load_tokenizer
from .roles import load_reward_fn


@dataclass
class Inputs:
    task: object                       # data.tasks.Task: model folder, built-in rows, verifier
    prompts: PromptCodec               # text <-> tokens, the chat template
    train_data: PromptDataset
    test_data: PromptDataset
    reward_fn: Callable[..., float]    # what the reward workers start with
    env_cls: type | None               # multi-turn episodes (envs/), or None


def load_inputs(cfg: Config, run_dir: str | Path | None = None) -> Inputs:
    """`run_dir`: an existing run's, which remembers its tokenizer."""
    # the user's own modules first: a broken one fails in seconds, not after the task's warm start
    reward_fn = None if cfg.reward.fn == "task" else load_reward_fn(cfg.reward.fn)
    env_cls = load_env(cfg.env.fn) if cfg.env.fn else None
    task = load_task(cfg)
    need, positions = cfg.data.max_prompt_len + cfg.rollout.max_new_tokens, task.max_positions
    if positions and need > positions:
        raise ConfigError(f"data.max_prompt_len + rollout.max_new_tokens = {need} tokens, more than the model's "
                          f"{positions} positions (max_position_embeddings in {task.model_dir}): lower them")
    prompts = PromptCodec(load_tokenizer(str(task.model_dir), run_dir), cfg.data)
    train = _dataset(cfg, prompts, cfg.data.train_path, task.train_rows, "train")
    test = _dataset(cfg, prompts, cfg.data.test_path, task.test_rows, "test")
    if reward_fn is None:
        reward_fn = task.verifier
    if task.reward_model_dir:  # a wrong folder costs nothing yet
        from .roles.reward_model import check_reward_model
        check_reward_model(str(task.reward_model_dir))
    return Inputs(task, prompts, train, test, reward_fn, env_cls)


def _dataset(cfg: Config, prompts: PromptCodec, path: str | None, builtin: list[dict], split: str) -> PromptDataset:
    d = cfg.data
    if path:
        numbered, problems = read_rows(path)
        source = str(path)
    else:
        numbered, problems, source = list(enumerate(builtin, start=1)), [], f"{cfg.task.name}/{split}"
    if split == "test" and d.test_size is not None:  # the file's first rows (numbered from 1), good or bad
        numbered = [(n, row) for n, row in numbered if n <= d.test_size]
        problems = [p for p in problems if p.row <= d.test_size]
    return validate_rows(numbered, d.prompt_key, d.max_prompt_len, lambda p: len(prompts.prompt_ids(p)),
                         source, problems, max_chars_per_token=prompts.max_chars_per_token)
