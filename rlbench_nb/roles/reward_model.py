"""Reward-model worker: a learned reward (a sequence classifier, one score per sequence) scored beside the
rule function, as in classic RLHF and verl's HybridFlow (`reward.model.path`).

The reward model usually has its own tokenizer and chat template, not the policy's: it reads the decoded
prompt and response text, re-encoded with its own tokenizer — as a user/assistant chat through its template
when it has one (`reward.model.chat_template`), else as the plain concatenation. Texts longer than
`reward.model.max_len` keep their end, where the response is. It never trains: forward passes only, in
micro-batches; with several ranks under Ray, FSDP2 shards it (each rank scores its share of the batch).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import Config, ConfigError
from ..data.batch import Batch
from ..metrics.memory import memory_snapshot
from ..ops.attention import load_model
from . import distributed as dist_util
from .common import DTYPES, pick_device


def check_reward_model(path: str | None) -> None:
    """One clear line, before any worker starts, for a reward.model.path that cannot be a reward model."""
    from transformers import AutoConfig
    if not path or not (Path(path) / "config.json").exists():
        raise ConfigError(f"reward.model.path={path!r} is not a local Hugging Face model folder (config.json and "
                          "weights): give the folder of a sequence-classification model, or leave it unset")
    labels = AutoConfig.from_pretrained(path).num_labels
    if labels != 1:
        raise ConfigError(f"reward.model.path={path}: the model has num_labels={labels}; a reward model gives one "
                          "score per sequence (num_labels=1)")


class RewardModelWorker:
    role = "reward_model"

    def __init__(self, cfg: Config, path: str | None = None):
        """`path`: the model's folder (default reward.model.path; the session resolves 'task' to the built-in one)."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer
        self.cfg = cfg
        rm = cfg.reward.model
        path = path or rm.path
        check_reward_model(path)
        path = Path(path)
        self.device = pick_device()
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.model = load_model(AutoModelForSequenceClassification, str(path), cfg.model.attention, self.device,
                                dtype=DTYPES[rm.dtype])
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.tokenizer.eos_token_id
        if pad is None:
            raise ConfigError(f"reward.model.path={rm.path}: its tokenizer has neither a pad nor an EOS token to pad "
                              "a batch with; set pad_token in its tokenizer_config.json")
        # the classifier reads the last non-pad token's score
        self.tokenizer.pad_token_id = self.model.config.pad_token_id = pad
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "right", "left"  # keep the response's end
        self.model.to(self.device).eval()
        self.sharded = dist_util.shard(self.model, self.device)

    def set_config(self, cfg: Config) -> None:
        """A branch's settings: the weights and the formatting can change; the model itself cannot."""
        if cfg.reward.model.path != self.cfg.reward.model.path:
            raise ConfigError("reward.model.path cannot change in a live session: start a new session")
        self.cfg = cfg

    @property
    def uses_chat_template(self) -> bool:
        mode = self.cfg.reward.model.chat_template
        return mode is True or (mode == "auto" and bool(getattr(self.tokenizer, "chat_template", None)))

    def texts(self, batch: Batch) -> list[str]:
        """What the reward model reads for each sample."""
        pairs = zip(batch["prompt"], batch["response"])
        if not self.uses_chat_template:
            return [p + r for p, r in pairs]
        chats = [[{"role": "user", "content": p}, {"role": "assistant", "content": r}] for p, r in pairs]
        return [self.tokenizer.apply_chat_template(chat, tokenize=False) for chat in chats]

    @torch.no_grad()
    def score(self, batch: Batch) -> Batch:
        """{"rm_scores_B": the model's score of each (prompt, response)}."""
        mbs = self.cfg.reward.model.micro_batch_size
        texts, parts = self.texts(batch), []
        n = -(-len(texts) // mbs)
        if self.sharded:  # every rank runs as many forwards (FSDP2 gathers weights in each): pad with a dummy
            n = int(dist_util.all_reduce_max(torch.tensor([float(n)]))[0])
        for i in range(n):
            chunk = texts[i * mbs:(i + 1) * mbs]
            scores = self._forward(chunk or [" "])
            if chunk:
                parts.append(scores)
        return Batch({"rm_scores_B": torch.cat(parts) if parts else torch.zeros(0)})

    def _forward(self, texts: list[str]) -> torch.Tensor:
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, truncation=True,
                             max_length=self.cfg.reward.model.max_len, add_special_tokens=not self.uses_chat_template)
        return self.model(**enc.to(self.device)).logits[:, 0].float().cpu()

    def memory(self) -> dict:
        return memory_snapshot()
