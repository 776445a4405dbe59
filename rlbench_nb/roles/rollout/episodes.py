"""Multi-turn episodes: the model and an environment (rlbench_nb/envs) take turns in one sequence, token in,
token out. `run_episodes` is the HF engine's; `run_episodes_by_turns` is vLLM's (a request per model turn).

The KV-cache loop of hf_engine.py, one token per step, with a queue of **forced tokens** per row: after the
model's turn ends (EOS, or its text ends with one of the environment's stop strings) the environment's step
runs (every row that ended a turn at this step at once, on a thread pool, within `step_timeout_s`), its
observation is encoded once and queued, and the row feeds those ids one per step instead of sampling — so the
sampled ids are kept exactly as drawn (no decode / re-encode of the conversation) and nothing is prefilled
twice. Output per row: `response_ids_BR` (the model's and the environment's tokens, interleaved),
`response_mask_BR` (every token of the episode: attention, and where it ends), `loss_mask_BR` (1 on the model's
own tokens only), `rollout_logprobs_BR` (0 on environment tokens), `env_scores_B` (the steps' rewards summed),
`num_turns_B`, `tool_calls_B`, `tool_errors_B`, and per row the reason an episode ended early
(`env_error`: a step that raised or hung, or an observation past the token budget; "" otherwise).
"""
from __future__ import annotations

import concurrent.futures
from collections import deque
from dataclasses import dataclass

import torch

from ...config import RolloutConfig
from ...data.batch import Batch
from ...envs import Env, run_steps
from .decode_step import model_step
from .kv_cache import reserved_cache


@torch.no_grad()
def run_episodes(model, tokenizer, envs: list[Env], rows: list[dict], p: RolloutConfig, sample,
                 pool: concurrent.futures.Executor, step_timeout_s: float, gen: torch.Generator | None = None, *,
                 prompt_ids=None, eos: int | None = None, pad: int | None = None, decode_step=None) -> Batch:
    """One episode per (env, row): `env.reset(row)` is the prompt (`prompt_ids(text)` encodes it: the session's
    own encoding, chat template included; default: the plain tokens); then model and environment take turns
    until the environment says done, `env.max_turns` model turns were taken, or `p.max_new_tokens` tokens (the
    model's and the environment's together) are spent. `sample(logits, p, gen) -> (tokens, logprobs)` is the
    engine's sampler; `decode_step` the engine's decode step (decode_step.py; None: the model's own forward)."""
    device = next(model.parameters()).device
    decode_step = decode_step or model_step(model)
    eos = tokenizer.eos_token_id if eos is None else eos
    pad = (tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos) if pad is None else pad
    encode = prompt_ids or (lambda text: tokenizer.encode(text, add_special_tokens=False))
    B, R = len(envs), p.max_new_tokens
    prompts = [encode(env.reset(row)) for env, row in zip(envs, rows)]
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(x)) + x for x in prompts], device=device)  # left padding
    attn = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in prompts], device=device)
    state = _Episodes.start(B, R, pad, prompt_mask=attn.cpu())
    rows_left = list(range(B))                       # batch row of each sequence still running
    next_pos = attn.sum(-1, keepdim=True)
    cache = reserved_cache(model.config, width + R)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=(attn.cumsum(-1) - 1).clamp(min=0),
                   past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
    steps = R
    for t in range(R):
        tok, logp = sample(logits.float(), p, gen)
        tok, logp = tok.cpu(), logp.cpu()
        ending = state.record(t, rows_left, tok, logp, envs, tokenizer, eos)
        if t == R - 1:  # the budget is spent: a turn cut short is scored as it stands
            ending = [i for i, r in enumerate(rows_left) if not state.forced[r] and (i in ending or state.turn_ids[r])]
        done = _take_steps(envs, [rows_left[i] for i in ending], state.turn_ids, state.turns, state.scores,
                           state.errors, state.forced, tokenizer, pool, step_timeout_s, room=[R - t - 1] * B)
        if t == R - 1:
            break
        finished = {i for i, r in enumerate(rows_left) if r in done}
        for i in finished:
            state.lengths[rows_left[i]] = t + 1
        if finished:
            keep = [i for i in range(len(rows_left)) if i not in finished]
            if not keep:
                steps = t + 1
                break
            index = torch.tensor(keep, device=device)
            rows_left = [rows_left[i] for i in keep]
            tok, next_pos, attn = tok[keep], next_pos[index], attn[index]
            cache.batch_select_indices(index)
        attn = torch.cat([attn, attn.new_ones((len(rows_left), 1))], dim=1)
        logits = decode_step(tok.to(device), next_pos, attn, cache)
        next_pos = next_pos + 1
    return state.batch(steps, ids.cpu(), envs)


@dataclass
class _Episodes:
    """What `run_episodes` has of each batch row r so far: its tokens (the model's and the environment's), their
    log-probs and loss mask, where it ended, the environment's tokens queued to feed (`forced`), the model's
    current turn, its turns, summed rewards and the error that ended it early."""
    tokens: torch.Tensor       # [B, R]
    logprobs: torch.Tensor     # [B, R], 0 on the environment's tokens
    loss_mask: torch.Tensor    # [B, R], 1 on the model's own tokens
    prompt_mask: torch.Tensor  # [B, P]
    lengths: list[int]
    forced: list[deque[int]]
    turn_ids: list[list[int]]  # the model's current turn, decoded whole (not token by token)
    turns: list[int]
    scores: list[float]
    errors: list[str | None]

    @classmethod
    def start(cls, B: int, R: int, pad: int, prompt_mask: torch.Tensor) -> _Episodes:
        return cls(tokens=torch.full((B, R), pad, dtype=torch.long), logprobs=torch.zeros((B, R)),
                   loss_mask=torch.zeros((B, R), dtype=torch.long), prompt_mask=prompt_mask, lengths=[R] * B,
                   forced=[deque() for _ in range(B)], turn_ids=[[] for _ in range(B)], turns=[0] * B,
                   scores=[0.0] * B, errors=[None] * B)

    def record(self, t: int, rows_left: list[int], tok, logp, envs: list[Env], tokenizer, eos: int) -> list[int]:
        """Token t of each running row: the environment's queued token (written into `tok`, fed next) or the
        sampled one. Returns the positions (in `rows_left`) whose model turn ends here."""
        ending: list[int] = []
        for i, r in enumerate(rows_left):
            if self.forced[r]:                       # the environment's token: fed, not sampled
                tok[i], logp[i] = self.forced[r].popleft(), 0.0
                continue
            self.loss_mask[r, t] = 1
            if tok[i] == eos:
                ending.append(i)
                continue
            self.turn_ids[r].append(int(tok[i]))
            stops = envs[r].stop_strings
            if stops:  # the turn's tail decoded whole: a stop string may share a token with the text around it
                tail = tokenizer.decode(self.turn_ids[r][-(max(map(len, stops)) + 1):])
                if any(s in tail for s in stops):
                    ending.append(i)
        self.tokens[rows_left, t], self.logprobs[rows_left, t] = tok, logp
        return ending

    def batch(self, steps: int, prompt_ids: torch.Tensor, envs: list[Env]) -> Batch:
        valid = (torch.arange(steps)[None, :] < torch.tensor(self.lengths)[:, None]).long()
        return Batch({"response_ids_BR": self.tokens[:, :steps], "response_mask_BR": valid,
                      "loss_mask_BR": self.loss_mask[:, :steps] * valid,
                      "rollout_logprobs_BR": self.logprobs[:, :steps] * valid,
                      "prompt_ids_BP": prompt_ids, "prompt_mask_BP": self.prompt_mask,
                      "env_scores_B": torch.tensor(self.scores), "num_turns_B": torch.tensor(self.turns),
                      "tool_calls_B": torch.tensor([getattr(env, "calls", 0) for env in envs]),
                      "tool_errors_B": torch.tensor([getattr(env, "errors", 0) for env in envs])},
                     {"env_error": [e or "" for e in self.errors]})


def _take_steps(envs, ending: list[int], turn_ids, turns, scores, errors, forced, tokenizer, pool,
                step_timeout_s: float, room: list[int]) -> set[int]:
    """The environment's answer to each row in `ending` (batch rows whose model turn just ended); queues the
    observations' ids (`room[r]`: the tokens row r has left). Returns the rows whose episode is over."""
    done: set[int] = set()
    if not ending:
        return done
    texts = [tokenizer.decode(turn_ids[r]) for r in ending]
    for r, step in zip(ending, run_steps([(envs[r], text) for r, text in zip(ending, texts)], pool, step_timeout_s)):
        turns[r] += 1
        scores[r] += step.reward
        turn_ids[r] = []
        if step.error:
            errors[r] = step.error
        if step.done or step.error or turns[r] >= envs[r].max_turns or room[r] <= 0:
            done.add(r)
            continue
        if step.observation:
            ids = tokenizer.encode(step.observation, add_special_tokens=False)
            if len(ids) >= room[r]:  # no room left for it and an answer: the episode ends here
                errors[r] = f"the observation ({len(ids)} tokens) does not fit the {room[r]} tokens left"
                done.add(r)
                continue
            forced[r].extend(ids)
    return done


def run_episodes_by_turns(generate_turns, tokenizer, envs: list[Env], rows: list[dict], p: RolloutConfig,
                          pool: concurrent.futures.Executor, step_timeout_s: float, *, prompt_ids=None,
                          eos: int, pad: int) -> Batch:
    """`run_episodes` for an engine that generates whole turns (vLLM): every running episode's next model turn is
    one request whose prompt is the episode so far, as token ids (the engine's prefix cache keeps re-reading it
    cheap); the turn is cut at the first stop string exactly where `run_episodes` would stop; the environment's
    steps, token budget and output are the same. `generate_turns(seqs, budgets, stop_ids) -> [(ids, logprobs)]`
    samples up to budgets[i] tokens after seqs[i], stopping at EOS and at `stop_ids` (stop strings that are a
    single token: the others are cut here, after the engine went past them)."""
    encode = prompt_ids or (lambda text: tokenizer.encode(text, add_special_tokens=False))
    B, R = len(envs), p.max_new_tokens
    prompts = [encode(env.reset(row)) for env, row in zip(envs, rows)]
    response: list[list[int]] = [[] for _ in range(B)]
    logprobs: list[list[float]] = [[] for _ in range(B)]
    loss_mask: list[list[int]] = [[] for _ in range(B)]
    turns, scores, errors = [0] * B, [0.0] * B, [None] * B
    forced: list[list[int]] = [[] for _ in range(B)]
    stop_ids = sorted({ids[0] for s in {s for env in envs for s in env.stop_strings}  # the engine may stop on these
                       if len(ids := tokenizer.encode(s, add_special_tokens=False)) == 1
                       and s in tokenizer.decode(ids)})  # only where `_turn_length` would stop there too
    running = [r for r in range(B) if R > 0]
    while running:
        outs = generate_turns([prompts[r] + response[r] for r in running], [R - len(response[r]) for r in running],
                              stop_ids)
        turn_ids: dict[int, list[int]] = {}
        empty = set()
        for r, (ids, lps) in zip(running, outs):
            if not ids:  # nothing sampled: the turn cannot end and spends no budget — the episode ends instead
                errors[r] = "the engine returned an empty turn"
                empty.add(r)
                continue
            n = _turn_length(ids, envs[r].stop_strings, tokenizer, eos)
            response[r] += ids[:n]
            logprobs[r] += lps[:n]
            loss_mask[r] += [1] * n
            turn_ids[r] = [t for t in ids[:n] if t != eos]
        room = {r: R - len(response[r]) for r in running}
        done = empty | _take_steps(envs, list(turn_ids), turn_ids, turns, scores, errors, forced, tokenizer, pool,
                                   step_timeout_s, room)
        for r in running:
            response[r] += forced[r]
            logprobs[r] += [0.0] * len(forced[r])
            loss_mask[r] += [0] * len(forced[r])
            forced[r] = []
        running = [r for r in running if r not in done]
    width_p, width_r = max(map(len, prompts)), max(1, max(map(len, response)))
    return Batch({"response_ids_BR": torch.tensor([x + [pad] * (width_r - len(x)) for x in response]),
                  "response_mask_BR": torch.tensor([[1] * len(x) + [0] * (width_r - len(x)) for x in response]),
                  "loss_mask_BR": torch.tensor([x + [0] * (width_r - len(x)) for x in loss_mask]),
                  "rollout_logprobs_BR": torch.tensor([x + [0.0] * (width_r - len(x)) for x in logprobs]),
                  "prompt_ids_BP": torch.tensor([[pad] * (width_p - len(x)) + x for x in prompts]),
                  "prompt_mask_BP": torch.tensor([[0] * (width_p - len(x)) + [1] * len(x) for x in prompts]),
                  "env_scores_B": torch.tensor(scores), "num_turns_B": torch.tensor(turns),
                  "tool_calls_B": torch.tensor([getattr(env, "calls", 0) for env in envs]),
                  "tool_errors_B": torch.tensor([getattr(env, "errors", 0) for env in envs])},
                 {"env_error": [e or "" for e in errors]})


def _turn_length(ids: list[int], stops: tuple[str, ...], tokenizer, eos: int) -> int:
    """How many of a turn's sampled ids `run_episodes` would have kept: up to EOS, or to the first token after
    which the turn's tail (decoded as there) holds a stop string."""
    width = max(map(len, stops)) + 1 if stops else 0
    for k, t in enumerate(ids):
        if t == eos:
            return k + 1
        if stops:
            tail = tokenizer.decode([x for x in ids[max(0, k + 1 - width):k + 1]])
            if any(s in tail for s in stops):
                return k + 1
    return len(ids)


def cat_episodes(parts: list[Batch], pad: int) -> Batch:
    """Episodes from several ranks as one batch: prompts left-padded, responses right-padded to common widths."""
    import torch.nn.functional as F
    width_p = max(b["prompt_ids_BP"].shape[1] for b in parts)
    width_r = max(b["response_ids_BR"].shape[1] for b in parts)
    out = []
    for b in parts:
        b = b.replace()
        for key in b.tensors:
            if key.endswith("_BP"):
                b[key] = F.pad(b[key], (width_p - b[key].shape[1], 0), value=pad if key == "prompt_ids_BP" else 0)
            elif key.endswith("_BR"):
                b[key] = F.pad(b[key], (0, width_r - b[key].shape[1]), value=pad if key == "response_ids_BR" else 0)
        out.append(b)
    return Batch.cat(out)
