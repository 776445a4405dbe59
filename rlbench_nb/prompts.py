"""Text <-> tokens for the controller: dataset rows into a prompt Batch, sampled tokens back into text.

    codec = PromptCodec(tokenizer, cfg.data)
    batch = codec.encode(rows, n=8, tag="s0")      # prompts repeated n times, left-padded; row fields ride along
    batch = codec.decode(batch)                    # + "response" text and response_len_B
"""
from __future__ import annotations

import json
from array import array
from functools import cache, cached_property
from pathlib import Path

import torch

from .config import ConfigError, DataConfig
from .data.batch import Batch
from .data.datasets import given_rows

TOKENIZER_CLASS_FILE = "tokenizer_class.json"  # in a run directory: the class AutoTokenizer chose for its model
MEMO_TOKENS = 32_000_000  # prompt tokens PromptCodec keeps (4 bytes each: 128 MB at most; GSM8K's train set is ~1M)


def load_tokenizer(model_dir: str, run_dir: str | Path | None = None):
    """AutoTokenizer's tokenizer for `model_dir`. To choose the class, AutoTokenizer imports transformers' model
    modules (~1.4-3 s: the largest part of re-attaching a controller, whose processes never load a model, and of a
    new kernel's start on a warm cluster); the run directory and the cache remember the class it chose
    (`remember_tokenizer`), loaded directly the next time for the same folder, configs and transformers version."""
    import transformers
    key = _tokenizer_key(model_dir)
    for seen in (_read_json(Path(run_dir) / TOKENIZER_CLASS_FILE) if run_dir is not None else {},
                 _read_json(_cached_choice(model_dir))):
        cls = getattr(transformers, str(seen.get("class")), None)
        if {k: seen.get(k) for k in key} == key and cls is not None:
            return cls.from_pretrained(str(model_dir))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model_dir))


def remember_tokenizer(run_dir: str | Path, tokenizer, model_dir: str) -> None:
    """What `load_tokenizer` reads back: the tokenizer's class, and what AutoTokenizer chose it from; in the run
    directory, and in the cache for a new run on the same folder (best effort: a read-only cache costs ~2 s)."""
    from .rundir import write_json
    choice = {"class": type(tokenizer).__name__, **_tokenizer_key(model_dir)}
    write_json(Path(run_dir) / TOKENIZER_CLASS_FILE, choice)
    try:
        _cached_choice(model_dir).parent.mkdir(parents=True, exist_ok=True)
        write_json(_cached_choice(model_dir), choice)
    except OSError:
        pass


def _cached_choice(model_dir: str) -> Path:
    import hashlib

    from .data.tasks.warm_start import cache_root
    return cache_root() / "tokenizer-classes" / f"{hashlib.sha256(str(model_dir).encode()).hexdigest()[:16]}.json"


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _tokenizer_key(model_dir: str) -> dict:
    """What AutoTokenizer's choice of class depends on: the folder's two configs and transformers' version."""
    import hashlib

    import transformers
    digest = hashlib.sha256()
    for name in ("config.json", "tokenizer_config.json"):
        path = Path(model_dir) / name
        digest.update(path.read_bytes() if path.is_file() else b"-")
    return {"model_dir": str(model_dir), "configs": digest.hexdigest(), "transformers": transformers.__version__}


class PromptCodec:
    def __init__(self, tokenizer, data: DataConfig, memo_tokens: int = MEMO_TOKENS):
        """`memo_tokens`: how many prompt tokens to keep (0 where texts rarely repeat: an episode's observations)."""
        self.tokenizer = tokenizer
        self.data = data
        if tokenizer.pad_token_id is None:
            tokenizer.pad_token = tokenizer.eos_token
        if tokenizer.eos_token_id is None:
            raise ConfigError(f"the tokenizer of {tokenizer.name_or_path} has no EOS token, so no response could "
                              "end: set tokenizer.eos_token in its tokenizer_config.json (a chat model's end-of-turn "
                              "token, e.g. <|im_end|>)")
        if data.chat_template and getattr(tokenizer, "chat_template", None):
            check_chat_template(tokenizer, data.system_prompt)
        # prompt -> its ids, filled when the dataset is checked (every prompt is counted then): a step's prompts
        # then cost no tokenizer call (a chat template's rendering is ~0.1 ms a prompt, on the step's path)
        self._memo: dict[tuple, array] = {}
        self._memo_room = memo_tokens

    @cached_property
    def max_chars_per_token(self) -> int:
        """The longest token's length in characters: a text of N characters has at least N / this tokens."""
        return max(map(len, self.tokenizer.get_vocab()), default=1)

    def given(self, rows, what: str) -> list[dict]:
        """Rows a caller hands a phase (`sess.rollout(rows)`), checked as a dataset's rows are, strictly
        (datasets.given_rows): a DatasetError naming each bad row, before any worker runs."""
        return given_rows(rows, self.data.prompt_key, self.data.max_prompt_len, lambda p: len(self._ids(p)), what,
                          self.max_chars_per_token)

    def prompt_ids(self, prompt: str) -> list[int]:
        """The prompt's token ids, wrapped in the tokenizer's chat template when it has one (data.chat_template)."""
        return self._ids(prompt).tolist()

    def _ids(self, prompt: str) -> array:
        tok, system = self.tokenizer, self.data.system_prompt
        template = getattr(tok, "chat_template", None) if self.data.chat_template else None
        key = (prompt, system, template)  # each can change in a session (sess.configure, a template being fixed)
        ids = self._memo.get(key)
        if ids is not None:
            return ids
        if template:
            text = tok.apply_chat_template(messages(prompt, system), tokenize=False, add_generation_prompt=True)
            ids = array("i", tok(text, add_special_tokens=False)["input_ids"])
        else:
            ids = array("i", tok(prompt if system is None else f"{system}\n\n{prompt}")["input_ids"])
        if len(ids) <= self._memo_room:
            self._memo[key] = ids
            self._memo_room -= len(ids)
        return ids

    def encode(self, rows: list[dict], n: int, tag: str) -> Batch:
        """Rows repeated n times, prompts tokenised (once per row) and left-padded. Samples of one row share
        a `group` id ('<tag>-<row>'); the rows' other fields ride along (`info["row_fields"]`); `info["tag"]`
        names the draw to the rollout engine (what `rewind` checks)."""
        ids = [self._ids(r["prompt"]) for r in rows]
        width = max(map(len, ids))
        # one row per prompt, left-padded into one flat array, then each repeated n times: a tensor from nested
        # lists cost ~15 ms (512 x 140), a tensor op per row ~10-20 µs each in a busy step
        flat, pad = array("i"), array("i", [self.tokenizer.pad_token_id]) * width
        for x in ids:
            flat += pad[len(x):]
            flat += x
        prompt_ids = (torch.frombuffer(flat, dtype=torch.int32) if flat else torch.zeros(0, dtype=torch.int32)
                      ).view(len(rows), width).long()
        lengths = torch.tensor([len(x) for x in ids])
        prompt_mask = (torch.arange(width) >= (width - lengths)[:, None]).long()
        meta = {"prompt": [r["prompt"] for r in rows for _ in range(n)],
                "group": [f"{tag}-{i}" for i in range(len(rows)) for _ in range(n)]}
        row_fields = sorted({k for r in rows for k in r} - {"prompt"})
        for key in row_fields:
            meta[key] = [r.get(key) for r in rows for _ in range(n)]
        return Batch({"prompt_ids_BP": prompt_ids.repeat_interleave(n, 0),
                      "prompt_mask_BP": prompt_mask.repeat_interleave(n, 0)}, meta,
                     {"row_fields": row_fields, "tag": tag})

    def decode(self, batch: Batch) -> Batch:
        """A new batch with the responses as text (special tokens dropped) and their lengths in tokens."""
        ids, mask = batch["response_ids_BR"], batch["response_mask_BR"]
        # the kept tokens of all rows as one list, cut by row, and one batch_decode: a decode call per row cost
        # ~5x (256 rows), a Python test per token ~8 ms (512 x 256)
        kept, lengths = ids[mask.bool()].tolist(), mask.sum(-1)
        ends = lengths.cumsum(0).tolist()
        rows = [kept[end - n:end] for end, n in zip(ends, lengths.tolist())]
        return batch.replace(response=batch_decode(self.tokenizer, rows), response_len_B=lengths)


def batch_decode(tokenizer, rows: list[list[int]]) -> list[str]:
    """`tokenizer.batch_decode(rows, skip_special_tokens=True)`. A fast tokenizer that cleans nothing up decodes
    in one call to its Rust backend: transformers' own decode is that backend's call per row after a Python
    walk over each row's ids (~5 µs a row; 64 rows ~0.3 ms of a busy tiny step)."""
    if _decodes_as_its_backend(type(tokenizer)) and not tokenizer.clean_up_tokenization_spaces:
        return tokenizer.backend_tokenizer.decode_batch(rows, skip_special_tokens=True)
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


@cache
def _decodes_as_its_backend(cls: type) -> bool:
    """The class decodes with transformers' fast-tokenizer `_decode` (the backend's `decode`, then the clean-up):
    not a slow tokenizer, nor one that decodes its own way."""
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:  # an older transformers: its own batch_decode
        return False
    return getattr(cls, "_decode", None) is TokenizersBackend._decode


def messages(prompt: str, system: str | None = None) -> list[dict]:
    """The conversation a prompt is: the user's turn, after a system message when one is set."""
    return ([{"role": "system", "content": system}] if system is not None else []) + \
        [{"role": "user", "content": prompt}]


PROBE = "Probe question 7 + 5 = ?"


def check_chat_template(tokenizer, system: str | None = None) -> None:
    """The tokenizer's chat template must keep the user's prompt (a template written for other message keys
    or roles renders nothing of it, and every rollout would then answer an empty conversation), and the
    system prompt when one is set (some templates refuse a system role, others drop it)."""
    try:
        text = tokenizer.apply_chat_template(messages(PROBE, system), tokenize=False, add_generation_prompt=True)
    except Exception as e:  # noqa: BLE001 - jinja2 raises its own TemplateError family
        what = "a plain user message" if system is None else "a system message (data.system_prompt)"
        raise ConfigError(f"the chat template of {tokenizer.name_or_path} fails on {what} ({type(e).__name__}: "
                          f"{e}): fix the template, or set data.chat_template=false") from None
    if PROBE not in text:
        raise ConfigError(f"the chat template of {tokenizer.name_or_path} drops the prompt: a user message "
                          f"{PROBE!r} renders as {text[:120]!r}: fix the template (it must write "
                          "message['content']), or set data.chat_template=false to send prompts as they are")
    if system is not None and system.strip() and system.strip() not in text:
        raise ConfigError(f"the chat template of {tokenizer.name_or_path} drops the system message "
                          f"(data.system_prompt): put the instruction into the prompts instead, or set "
                          "data.chat_template=false")


def generate_inputs(batch: Batch) -> Batch:
    """What a rollout engine reads: the prompt tokens."""
    return batch.only("prompt_ids_BP", "prompt_mask_BP")


def reward_inputs(batch: Batch) -> Batch:
    """What a reward function is given: prompt, response and the dataset row's fields."""
    return batch.only("prompt", "response", *batch.info.get("row_fields", ()))
