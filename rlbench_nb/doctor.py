"""`sess.doctor()`: certify a live session before a long run. One line per check, passed or failed with
the number measured, the likely cause and the fix; the session is left as it was (the checks that step run
on a branch at learning rate 0, which returns to the main line's snapshot, and its folder is removed).

    report = sess.doctor()          # shows itself in a notebook; report.ok, report.failed
    rlbench-nb doctor configs/arith_grpo.yaml [key=value ...]   # exit 1 when a check fails

It looks for what trains the wrong policy without a single error, as researchers of every framework have
met it: rollouts on stale weights after a push (TRL #5312), log-probs zero-filled into huge importance
ratios (NeMo-RL #4218), settings that silently do nothing (SkyRL #644), a reward that is not a function of
its sample, responses that never end or carry padding, a chat template that loses the prompt.
"""
from __future__ import annotations

import shutil
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .config import Config
from .errors import RLBenchError, UsageError, is_count

if TYPE_CHECKING:
    from .session import Session

# what the doctor's own step changes: nothing (lr 0), on a separate forward (the update's own forward would
# make the ratio 1 by construction), with the clipped loss whose ratio statistics it reads
DOCTOR_OVERRIDES = ("train.lr=0", "train.critic_lr=0", "algo.reuse_logprobs=false", "algo.policy_loss=ppo",
                    "train.critic_warmup=0")
# |log p| two forwards of the same weights may differ by: fp32 sums in another order (micro-batches, packing,
# chunked heads) stay near 1e-6; bf16 rounds each activation to 8 bits of mantissa
SAME_WEIGHTS_TOL = {"float32": 1e-4, "bfloat16": 2e-2}
# the engine's log-probs against the trainer's, mean |Δ| per token: the HF engine runs the trainer's own
# modules (measured 1e-5 on SmolLM2-135M in fp32); vLLM's kernels differ (fp32 on CPU ~1e-3); bf16 is
# algo.mismatch_alarm's business
ENGINE_TOL = {("hf", "float32"): 1e-3, ("vllm", "float32"): 1e-2}


@dataclass
class Check:
    name: str
    ok: bool | None  # None: does not apply to this session (the detail says why)
    detail: str      # what was measured
    fix: str = ""    # failed: the likely cause and what to do

    def line(self) -> str:
        mark = {True: "ok  ", False: "FAIL", None: "--  "}[self.ok]
        fix = f"\n       -> {self.fix}" if self.ok is False and self.fix else ""
        return f"{mark} {self.name}: {self.detail}{fix}"


@dataclass
class Report:
    checks: list[Check]
    seconds: float

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    @property
    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.ok is False]

    def __getitem__(self, name: str) -> Check:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(f"no check named {name!r}; these ran: {[c.name for c in self.checks]}")

    def __str__(self) -> str:
        passed = sum(c.ok is True for c in self.checks)
        end = (f"all {passed} checks passed" if self.ok else
               f"{len(self.failed)} of {passed + len(self.failed)} checks FAILED") + f" ({self.seconds:.1f} s)"
        return "\n".join([c.line() for c in self.checks] + [end])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        import html
        return f"<pre style='font-size:12px'>{html.escape(str(self))}</pre>"


def examine(sess: Session, rows: int = 4) -> Report:
    """Run every check on `rows` training prompts (the first ones: the data position does not move)."""
    from .branches import branch, branch_dir
    if not is_count(rows, 1):
        raise UsageError(f"rows={rows!r}: how many training prompts to check, 1 or more (default 4)")
    t0 = time.perf_counter()
    data = sess.train_data.rows[:rows]
    checks = idle_settings(sess.cfg) + [prompt_round_trip(sess.prompts, data)]
    with branch(sess, "doctor", DOCTOR_OVERRIDES, keep=False) as b:
        done: list[str] = []  # the phases that ran: an error names the one that did not
        try:
            _step(sess, data, b, done, checks)
        except RLBenchError as e:  # a push the engine did not take (WeightSyncError), a worker's error, ...
            phase = ("rollout", "score", "prepare", "update")[len(done)]
            checks.append(Check(f"a step at lr 0 on these samples ({phase})", False, f"{type(e).__name__}: {e}",
                                "the checks above say what the prompts or samples lack; the message names the part"))
    shutil.rmtree(branch_dir(sess.run_dir, "doctor"), ignore_errors=True)
    sess.branches.pop("doctor", None)
    return Report(checks, time.perf_counter() - t0)


def _step(sess: Session, data: list[dict], b, done: list[str], checks: list[Check]) -> None:
    """Roll out `data`, score (twice), prepare and update at learning rate 0, each checked into `checks`
    as it ends (a phase that raises keeps the checks before it)."""
    batch = sess.rollout(data)
    done.append("rollout")
    checks += sample_checks(batch, sess.tokenizer, sess.cfg.rollout.max_new_tokens)
    scored, again = sess.score(batch), sess.score(batch)
    done.append("score")
    checks += reward_checks(scored, again)
    was_step_zero = sess.step_count == 0
    prepared = sess.prepare(scored)
    done.append("prepare")
    checks.append(logprob_values(batch, prepared))
    checks.append(adapter_in_engine(sess, batch, prepared))
    checks += update_checks(sess, sess.update(prepared), was_step_zero, b)


# ---- settings ----------------------------------------------------------------------------------------
def idle_settings(cfg: Config) -> list[Check]:
    """Settings given a value other than their default that this layout never reads, each named."""
    default = Config()
    a, t = cfg.algo, cfg.train
    rules = [  # (keys, when they do nothing, why, the fix)
        (("algo.kl_estimator", "algo.kl_in", "algo.kl_ctrl", "algo.target_kl", "algo.kl_horizon"),
         not cfg.uses_reference, "algo.kl_coef=0: no reference model, no KL", "set algo.kl_coef > 0"),
        (("algo.target_kl", "algo.kl_horizon"), cfg.uses_reference and a.kl_ctrl == "fixed",
         "algo.kl_ctrl=fixed reads neither", "set algo.kl_ctrl=adaptive"),
        (("algo.rollout_is_cap",), a.rollout_is == "off", "algo.rollout_is=off", "set algo.rollout_is=tis"),
        (("algo.reuse_logprobs",), a.reuse_logprobs and (t.epochs > 1 or t.mini_batches > 1 or a.rollout_is != "off"),
         "reuse is exact only with one epoch of one mini-batch and no rollout_is: prepare runs its own forward",
         "drop it, or train one epoch of one mini-batch"),
        (("algo.lam", "algo.value_clip", "train.critic_lr", "train.critic_warmup"), not cfg.uses_critic,
         f"algo.advantage={a.advantage} has no critic", "set algo.advantage=gae for a critic"),
        (("reward.rule_weight", "reward.model.weight", "reward.model.ranks", "reward.model.micro_batch_size",
          "reward.model.dtype", "reward.model.max_len"), not cfg.reward.model.path,
         "no reward model (reward.model.path)", "set reward.model.path"),
        (("model.lora.alpha", "model.lora.target_modules", "model.lora.dropout"), not cfg.model.lora.r,
         "model.lora.r=0: no adapters", "set model.lora.r > 0"),
        (("rollout.top_p", "rollout.top_k"), cfg.rollout.temperature == 0, "rollout.temperature=0 is greedy",
         "set rollout.temperature > 0"),
    ]
    out = []
    for keys, idle, why, fix in rules:
        changed = [k for k in keys if idle and _get(cfg, k) != _get(default, k)]
        if changed:
            out.append(Check(f"settings that do something: {', '.join(changed)}", False,
                             f"set, but never read here ({why})", f"{fix}, or remove the setting"))
    return out or [Check("settings that do something", True, "every setting changed from its default is read")]


def _get(cfg: Config, dotted: str):
    value = cfg
    for part in dotted.split("."):
        value = getattr(value, part)
    return value


# ---- prompts and samples ------------------------------------------------------------------------------
def prompt_round_trip(prompts, rows: list[dict]) -> Check:
    """Each prompt's text survives its chat template and the tokenizer: decoded, the model's input holds it."""
    tok = prompts.tokenizer
    lost = [r["prompt"] for r in rows
            if " ".join(r["prompt"].split()) not in " ".join(tok.decode(prompts.prompt_ids(r["prompt"])).split())]
    if lost:
        return Check("prompts survive the chat template", False, f"{len(lost)} of {len(rows)} prompts are not in "
                     f"the model's decoded input (first: {lost[0][:60]!r})",
                     "the template or the tokenizer loses text (a template on other message keys, characters "
                     "the vocabulary lacks): fix the template, or data.chat_template=false")
    return Check("prompts survive the chat template", True, f"{len(rows)} of {len(rows)} decode back to their text")


def sample_checks(batch, tokenizer, max_new: int) -> list[Check]:
    """The engine's own outputs: finite, non-positive log-probs; ids in the vocabulary; responses that end
    at EOS or the length cap, with no padding inside."""
    mask = batch["response_mask_BR"].bool()
    ids, lp = batch["response_ids_BR"], batch["rollout_logprobs_BR"].float()
    bad = (~torch.isfinite(lp) | (lp > 1e-6)) & mask
    out = [Check("sampled log-probs are finite and <= 0", not bad.any(),
                 f"{int(bad.sum())} of {int(mask.sum())} sampled tokens are NaN, inf or positive",
                 "the engine returns something else than log-probabilities (logits, or probabilities)")]
    vocab = len(tokenizer)
    outside = ((ids < 0) | (ids >= vocab)) & mask
    out.append(Check("sampled ids are in the vocabulary", not outside.any(),
                     f"{int(outside.sum())} sampled ids outside the tokenizer's {vocab}",
                     "the model's embedding has rows the tokenizer does not (padded vocabulary): mask them"))
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    lengths = mask.sum(-1)
    inside, unended = 0, 0
    for i, n in enumerate(lengths.tolist()):
        resp = ids[i, :n].tolist()
        inside += any(t in (eos, pad) for t in resp[:-1])
        unended += n < max_new and (not resp or resp[-1] != eos)
    capped = int((lengths >= max_new).sum())
    out.append(Check("responses end at EOS or the length cap", not inside and not unended,
                     f"{inside} hold EOS or the pad token inside, {unended} stopped early without EOS; {capped} of "
                     f"{len(lengths)} reached rollout.max_new_tokens={max_new}",
                     "the engine stops on another token than the tokenizer's EOS (check generation_config.json's "
                     "eos_token_id against the tokenizer's), or pads inside a response"))
    return out


def reward_checks(scored, again) -> list[Check]:
    """The reward function scores every sample, and the same samples the same way twice."""
    errors = [e for e in scored["reward_error"] if e]
    out = [Check("the reward scores every sample", not errors, f"{len(errors)} of {len(scored)} samples raised "
                 f"or returned no number" + (f" (first: {errors[0][:100]})" if errors else ""),
                 "fix the reward function (the error names its line); until then those samples score 0")]
    a, b = scored["scores_B"], again["scores_B"]
    differ = int((a != b).sum())
    out.append(Check("the reward gives the same score twice", not differ,
                     f"{differ} of {len(a)} samples scored differently on a second call",
                     "the reward depends on something else than its sample (a random draw, a clock, state kept "
                     "between calls): seed it from the sample, or reset its state"))
    return out


def logprob_values(batch, prepared) -> Check:
    """Where the engine says a sampled token was certain (log-prob exactly 0), the trainer must agree:
    zeros the trainer does not share are log-probs filled in, not computed."""
    mask = batch["response_mask_BR"].bool()
    engine, trainer = batch["rollout_logprobs_BR"].float(), prepared["old_logprobs_BR"].float()
    filled = (engine == 0) & (trainer < -1e-3) & mask
    return Check("no zero-filled log-probs", not filled.any(),
                 f"{int(filled.sum())} of {int(mask.sum())} sampled tokens have log-prob 0 from the engine where "
                 "the trainer's is below -1e-3",
                 "the engine did not return log-probs for these tokens (a missing logprobs request, a dropped "
                 "field zero-filled): importance ratios on them are wrong")


def adapter_in_engine(sess: Session, batch, prepared) -> Check:
    """With LoRA: the engine samples from the adapted model, not the base one. The trainer's log-probs with
    the adapters on and off say how far the adapter moves the model; the engine's must have moved with it."""
    from .roles import PolicyWorker
    name = "the LoRA adapter reaches the engine"
    if not sess.cfg.model.lora.r:
        return Check(name, None, "no adapters (model.lora.r=0)")
    base = (prepared if "ref_logprobs_BR" in prepared  # the LoRA reference is the model with adapters off
            else sess.groups["policy"].call_split(PolicyWorker.reference_logprobs, batch))["ref_logprobs_BR"]
    mask = batch["response_mask_BR"].bool()
    trainer, engine = prepared["old_logprobs_BR"].float(), batch["rollout_logprobs_BR"].float()
    trained = (trainer - base.float()).abs()[mask].mean().item()
    moved = (engine - base.float()).abs()[mask].mean().item()
    off = (engine - trainer).abs()[mask].mean().item()
    if trained < 1e-4:
        return Check(name, None, f"the adapter is still (near) zero: it moves log-probs by {trained:.1e} per token")
    # and nearer the trainer than the base: a bf16 engine (rollout.dtype) is `moved` off the base by its rounding
    # alone, adapter or not
    return Check(name, moved >= 0.5 * trained and off < moved, f"the adapter moves the trainer's log-probs by "
                 f"{trained:.2e} per token and the engine's by {moved:.2e}; engine to trainer {off:.2e}",
                 "the engine samples from the base model without the adapter (verl #7495): the push must merge "
                 "the adapter into the weights it sends; sess.sync_weights() pushes again")


# ---- the lr-0 step -------------------------------------------------------------------------------------
def update_checks(sess: Session, row: dict, was_step_zero: bool, b) -> list[Check]:
    dtype, engine = sess.cfg.model.dtype, sess.cfg.rollout.engine
    same = SAME_WEIGHTS_TOL.get(dtype, 2e-2)
    ratio = row.get("actor/log_ratio_abs")
    out = [Check("the update's forward equals prepare's (ratio 1)", None if ratio is None else ratio <= same,
                 "no policy step ran" if ratio is None else f"mean |log ratio| {ratio:.2e} at lr 0 (bound {same:g})",
                 "the trainer's forward differs from prepare's on the same weights: dropout left on, a different "
                 "attention path, or packed sequences that leak across their boundaries")]
    kl = row.get("kl/ref")
    if not sess.cfg.uses_reference:
        out.append(Check("KL to the reference at step 0", None, "no reference (algo.kl_coef=0)"))
    elif not was_step_zero:
        out.append(Check("KL to the reference at step 0", None, f"the policy has trained {sess.step_count - 1} steps"))
    else:
        out.append(Check("KL to the reference at step 0", kl is not None and abs(kl) <= same, f"kl/ref {kl:.2e}",
                         "the reference is not the starting policy: another model.path, dtype or adapters"))
    out.append(_engine_agreement(row, engine, sess.workers.rollout_dtype(), sess.cfg.algo.mismatch_alarm or 0.05))
    change = b.weight_change()
    moved = max(change.values(), default=0.0)
    out.append(Check("an update at lr 0 moves no weight", moved == 0.0, f"largest relative change {moved:.2e}",
                     "the optimizer changes weights without the learning rate (weight decay applied apart from "
                     "it, a custom step)"))
    verified = row.get("sync/verified")
    out.append(Check("the weight push is verified", None if not verified else True,
                     f"{row.get('sync/bytes', 0) / 1e6:.1f} MB read back by every engine" if verified else
                     f"the {engine} engine does not read its weights back: the log-prob comparison stands in"))
    return out


def _engine_agreement(row: dict, engine: str, dtype: str, alarm: float) -> Check:
    mean, worst = row.get("mismatch/logp_abs_mean"), row.get("mismatch/logp_abs_max")
    bound = ENGINE_TOL.get((engine, dtype), alarm)
    if mean is None:
        return Check("engine and trainer log-probs agree", None, "no mismatch measured (no policy step)")
    return Check("engine and trainer log-probs agree", mean <= bound,
                 f"mean |Δ log p| {mean:.2e}, max {worst:.2e} ({engine}, {dtype}; bound {bound:g})",
                 "the engine samples from other weights than the trainer's: a push that did not land (stale "
                 "weights), an adapter not loaded, or another dtype; sess.sync_weights() pushes again")
