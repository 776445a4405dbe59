"""What each Tinker call does to a live Session: the training client's calls go to its policy workers, the sampling
client's to its rollout engines, saves and loads to its run directory's checkpoints, and every optimizer step
becomes one of the session's steps (a metrics row the dashboard draws). Every call runs as a session phase
(guard.py): a notebook cell and a served client take turns on the workers, never both at once.

One policy, many clients: every training client (`create_model`) trains the session's one policy, from the
weights it holds. Two clients' gradients never meet in one optimizer step: while one client's `forward_backward`
has gradients waiting for its `optim_step`, another client's training calls are refused (and say whose).
"""
from __future__ import annotations

import collections
import re
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..algos.tinker_losses import TINKER_LOSSES, LossInputError, loss_config
from ..data.batch import Batch
from ..errors import root_cause
from ..roles.policy import PolicyWorker
from ..roles.rollout.base import RolloutWorker
from ..roles.tinker_ops import GradientsDropped, NonFiniteGradient
from . import samples
from .wire import Datum, encode_forward_backward, encode_sample

ADAM_DEFAULTS = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0,
                 "grad_clip_norm": 0.0}
INPUT_KEYS = {"weights": "weights_BT", "logprobs": "logprobs_BT", "advantages": "advantages_BT"}
CLIENT_GONE_S = 60  # a client session silent this long (the SDK beats every 10 s) no longer holds the gradients


class TinkerUserError(ValueError):
    """A request this server refuses: the SDK raises it as RequestFailedError (category user) with this message."""


@dataclass
class Sampler:
    sampler_id: str
    base_model: str
    weights: str            # the weights it samples: the session's weights epoch (guard.py) when it was made
    model_path: str | None = None


@dataclass
class PendingGradients:
    owner: str | None = None        # the training model whose forward_backward left gradients on the policy
    epoch: str = ""                 # the weights they were computed on (guard.epoch): a phase changing them voids them
    loss_sum: float = 0.0
    datums: int = 0
    tokens: int = 0
    seconds: float = 0.0


def checkpoint_name(model_id: str, kind: str, name: str) -> str:
    """The run directory's checkpoint for a tinker:// path: `tinker-<model>-<kind>-<name>`, filesystem-safe."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", f"tinker-{model_id}-{kind}-{name}")


def parse_path(path: str) -> tuple[str, str, str]:
    """tinker://<model_id>/<weights|sampler_weights>/<name> -> (model_id, kind, name)."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in ("weights", "sampler_weights") or not parts[2]:
        raise TinkerUserError(f"'{path}' is not a checkpoint path of this server: tinker://<model_id>/weights/<name> "
                              "(save_state) or tinker://<model_id>/sampler_weights/<name> (save_weights_for_sampler)")
    return parts[0], parts[1], parts[2]


class TinkerBackend:
    def __init__(self, sess):
        self.sess = sess
        self.models: set[str] = set()  # the training clients' model ids: each trains the session's one policy
        self.samplers: dict[str, Sampler] = {}
        self.grads = PendingGradients()
        self.samples: collections.deque[Batch] = collections.deque(maxlen=50)  # what clients sampled, newest last
        self.seen: dict[str, float] = {}  # client session -> its last sign of life (monotonic; 0: it finished)
        cfg = sess.cfg
        self.lora_rank = cfg.model.lora.r or None
        self.model_name = cfg.model.path or "rlbench-nb/task"
        self.vocab = len(sess.tokenizer)
        self.tokenizer_id = _tokenizer_folder(sess)  # once: get_info answers on the event loop

    # ---- models ---------------------------------------------------------------------------------
    def accepts(self, base_model: str | None) -> bool:
        if not base_model or base_model == self.model_name:
            return True
        return bool(self.sess.cfg.model.path) and Path(base_model).expanduser().resolve() == \
            Path(self.sess.cfg.model.path).expanduser().resolve()

    def create_model(self, model_id: str, base_model: str, lora_rank: int | None) -> dict:
        if not self.accepts(base_model):
            raise TinkerUserError(f"this server trains '{self.model_name}' (the session's model.path), not "
                                  f"'{base_model}': pass base_model='{self.model_name}', or serve a session of that "
                                  "model")
        if self.lora_rank and lora_rank and lora_rank != self.lora_rank:
            raise TinkerUserError(f"this session trains LoRA adapters of rank {self.lora_rank} (model.lora.r), not "
                                  f"{lora_rank}: ask for rank={self.lora_rank}, or serve a session with "
                                  f"model.lora.r={lora_rank}")
        self.models.add(model_id)
        return {"model_id": model_id, "type": "create_model"}

    def model(self, model_id: str) -> None:
        if model_id not in self.models:
            raise TinkerUserError(f"no training model '{model_id}' on this server (create_lora_training_client "
                                  f"first; a server restart forgets its clients: create them again)")

    def info(self, model_id: str) -> dict:
        self.model(model_id)
        return {"model_id": model_id, "type": "get_info", "model_name": self.model_name,
                "is_lora": bool(self.lora_rank), "lora_rank": self.lora_rank,
                "model_data": {"model_name": self.model_name, "tokenizer_id": self.tokenizer_id}}

    # ---- training -------------------------------------------------------------------------------
    def alive(self, model_id: str) -> bool:
        session = model_id.split(":train:")[0]
        return time.monotonic() - self.seen.get(session, time.monotonic()) < CLIENT_GONE_S

    def drop_gradients(self) -> None:
        """Clear the policy's accumulated gradients and who held them (srv.drop_gradients())."""
        with self._phase("drop gradients"):
            self.sess.groups["policy"].call(PolicyWorker.tinker_zero_grad)
            self.grads = PendingGradients()

    def _claim(self, model_id: str, what: str) -> None:
        """Refuse a client's training call while another holds gradients; release a holder that went away, and
        gradients that a session phase (an update, a load, a restore) voided since they were computed."""
        g = self.grads
        if g.owner is not None and (not self.alive(g.owner) or g.epoch != self.sess.guard.epoch):
            stale, voided = g.owner, g.epoch != self.sess.guard.epoch
            self.drop_gradients()
            if stale == model_id and voided:
                raise TinkerUserError(f"cannot {what}: a session phase changed the policy's weights since this "
                                      "client's forward_backward (an update, a load, a restore), so its gradients "
                                      "were dropped, nothing applied: send the step's data again")
        owner = self.grads.owner
        if owner is not None and owner != model_id:
            raise TinkerUserError(f"cannot {what} for '{model_id}': training client '{owner}' has gradients on this "
                                  "session's policy that its optim_step has not applied yet, and two clients' "
                                  "gradients are never mixed into one step. Let it finish its step first (or "
                                  "srv.drop_gradients() in the notebook)")

    def datum_batch(self, datums: list[Datum], loss_fn: str) -> Batch:
        needs = TINKER_LOSSES[loss_fn][0]
        T = max(len(d.tokens) for d in datums)
        out = {"input_ids_BT": torch.zeros(len(datums), T, dtype=torch.long),
               "input_mask_BT": torch.zeros(len(datums), T, dtype=torch.long),
               "target_ids_BT": torch.zeros(len(datums), T, dtype=torch.long)}
        for key in needs:
            out[INPUT_KEYS[key]] = torch.zeros(len(datums), T)
        for i, d in enumerate(datums):
            missing = [k for k in ("target_tokens", *needs) if k not in d.inputs]
            if missing:
                raise TinkerUserError(f"datum {i}: loss_fn '{loss_fn}' needs loss_fn_inputs {missing} (it has "
                                      f"{sorted(d.inputs)})")
            ids = np.concatenate([d.tokens, d.inputs["target_tokens"].astype(np.int64)])
            if ids.min() < 0 or ids.max() >= self.vocab:
                raise TinkerUserError(f"datum {i}: token id {int(ids.max() if ids.max() >= self.vocab else ids.min())}"
                                      f" is outside the model's vocabulary (0..{self.vocab - 1})")
            n = len(d.tokens)
            out["input_ids_BT"][i, :n] = torch.from_numpy(d.tokens)
            out["input_mask_BT"][i, :n] = 1
            out["target_ids_BT"][i, :n] = torch.from_numpy(d.inputs["target_tokens"].astype(np.int64))
            for key in needs:
                values = torch.from_numpy(d.inputs[key].astype(np.float32))
                if not torch.isfinite(values).all():
                    raise TinkerUserError(f"datum {i}: loss_fn_inputs['{key}'] holds inf or NaN")
                out[INPUT_KEYS[key]][i, :n] = values
        return Batch(out)

    def forward_backward(self, model_id: str, datums: list[Datum], loss_fn: str, config: dict,
                         forward_only: bool) -> bytes:
        self.model(model_id)
        try:
            cfg = loss_config(loss_fn, config)
        except LossInputError as e:
            raise TinkerUserError(str(e)) from e
        if not datums:
            raise TinkerUserError("forward_backward got no datums")
        if not forward_only:
            self._claim(model_id, "forward_backward")
        batch = self.datum_batch(datums, loss_fn)
        policy = self.sess.groups["policy"]
        if len(batch) < policy.world_size:
            raise TinkerUserError(f"{len(batch)} datum(s) for {policy.world_size} policy ranks: send at least one "
                                  "a rank")
        t0 = time.perf_counter()
        with self._phase("forward" if forward_only else "forward_backward"):
            try:
                parts = policy.call_shards(PolicyWorker.tinker_forward_backward, batch, loss_fn, cfg, forward_only)
            except BaseException:  # the workers dropped every gradient since the last step (roles/tinker_ops.py)
                if not forward_only:
                    self.grads = PendingGradients()
                raise
        logprobs = [x.numpy() for p in parts for x in p["logprobs"]]
        losses = [x.numpy() for p in parts for x in p["elementwise_loss"]]
        total = sum(p["loss_sum"] for p in parts)
        if not forward_only:
            g = self.grads
            g.owner, g.epoch = model_id, self.sess.guard.epoch
            g.loss_sum, g.datums = g.loss_sum + total, g.datums + len(datums)
            g.tokens += int(batch["input_mask_BT"].sum())
            g.seconds += time.perf_counter() - t0
        return encode_forward_backward({"logprobs": logprobs, "elementwise_loss": losses}, {"loss:sum": total})

    def optim_step(self, model_id: str, adam: dict) -> dict:
        self.model(model_id)
        self._claim(model_id, "optim_step")
        adam = {**ADAM_DEFAULTS, **{k: float(v) for k, v in (adam or {}).items() if k in ADAM_DEFAULTS}}
        t0 = time.perf_counter()
        with self._phase("optim_step", changes_state=True):
            g, self.grads = self.grads, PendingGradients()
            try:
                out = self.sess.groups["policy"].call(PolicyWorker.tinker_optim_step, adam, g.datums > 0)[0]
            except BaseException as e:  # as Session.update: a step that may have moved some weights needs a resync
                if not isinstance(root_cause(e), (NonFiniteGradient, GradientsDropped)):
                    self.sess.state = "needs_resync"
                raise
            m = {"tinker/loss_sum": g.loss_sum, "tinker/datums": float(g.datums), "tinker/tokens": float(g.tokens),
                 "actor/grad_norm": out["grad_norm"], "train/lr": adam["learning_rate"]}
            self.sess.progress.trainer_steps["policy"] = out["adam_steps"]
            try:  # a push that fails still counts the step (workers.push_failed: the next rollout pushes first)
                m.update(self.sess.workers.sync(self.sess.step_count + 1))  # the engine samples what was trained
            finally:
                m["time/update_s"] = g.seconds + time.perf_counter() - t0
                self._record(m)
        return {"metrics": {"grad_norm": out["grad_norm"], "learning_rate": adam["learning_rate"]}}

    def _record(self, m: dict) -> None:
        """The optimizer step as one of the session's steps, recorded as `Session.update` records its own: the lease
        checked, the count moved with controller_state.json written (or neither), then the metrics row. A write that
        fails leaves the session `needs_resync`, its count where the files say."""
        sess = self.sess
        with sess.guard.recording(f"Step {sess.step_count + 1}'s optimizer step was applied"):
            sess.lease.renew()  # first: a session taken over mid-step writes nothing more
            with sess.progress.committing(None, int(m["tinker/datums"])):
                sess.rundir.write_state(sess.controller_state())
            sess.metrics.record_step(sess.step_count, m)
        sess.metrics.notify(m)

    def _phase(self, what: str, changes_state: bool = False):
        self.sess.lease.check(f"serve {what}")
        return self.sess.guard.phase(f"serve {what}", changes_state)

    # ---- checkpoints ----------------------------------------------------------------------------
    def save(self, model_id: str, name: str, kind: str) -> dict:
        """save_state ("weights") and a named save_weights_for_sampler ("sampler_weights"): a checkpoint of the run
        directory (sess.save: weights, optimizer, RNG, the session's own state), loadable by sess.load too."""
        self.model(model_id)
        if self.grads.owner is not None:
            raise TinkerUserError("cannot save with gradients waiting for optim_step: a checkpoint holds weights and "
                                  "optimizer state, not half a step. Call optim_step first")
        self.sess.save(checkpoint_name(model_id, kind, name))
        path = f"tinker://{model_id}/{kind}/{name}"
        if kind == "sampler_weights":
            self.samplers[path] = Sampler(path, self.model_name, self.sess.guard.epoch, path)
        return {"path": path, "type": "save_weights" if kind == "weights" else "save_weights_for_sampler"}

    def load(self, model_id: str, path: str) -> dict:
        """load_state / create_training_client_from_state: the session returns to that checkpoint (sess.load:
        weights, optimizer state, and the session's step with them)."""
        owner, kind, name = parse_path(path)
        if kind != "weights":
            raise TinkerUserError(f"'{path}' holds sampler weights; load_state takes a save_state path "
                                  "(.../weights/...)")
        ckpt = checkpoint_name(owner, kind, name)
        if not (self.sess.run_dir / "checkpoints" / ckpt).exists():
            raise TinkerUserError(f"no checkpoint for '{path}' in {self.sess.run_dir / 'checkpoints'} (this server "
                                  "keeps save_state checkpoints in the served session's run directory)")
        self.sess.load(ckpt)  # a new weights epoch: gradients computed before it are void (_claim drops them)
        self.models.add(model_id)
        return {"path": path, "model_id": model_id, "type": "load_weights"}

    # ---- sampling -------------------------------------------------------------------------------
    def sampler(self, sampler_id: str, model_path: str | None, base_model: str | None) -> Sampler:
        """A sampling session on saved sampler weights (`model_path`), or on the weights the policy holds now."""
        if model_path:
            if model_path not in self.samplers:
                parse_path(model_path)
                raise TinkerUserError(f"no sampler weights '{model_path}' on this server: save_weights_for_sampler "
                                      "first (sampler weights are served while they are the policy's latest)")
            s = Sampler(sampler_id, self.model_name, self.samplers[model_path].weights, model_path)
        else:
            if not self.accepts(base_model):
                raise TinkerUserError(f"this server samples '{self.model_name}', not '{base_model}'")
            s = Sampler(sampler_id, self.model_name, self.sess.guard.epoch)
        self.samplers[sampler_id] = s
        return s

    def sample(self, sampler_id: str, prompt: list[int], n: int, params: dict) -> bytes:
        out = self.sample_many([(sampler_id, prompt, n, params)])[0]
        if isinstance(out, Exception):
            raise out
        return out

    def sample_many(self, requests: list[tuple]) -> list:
        """Sample requests of one sampler and one set of sampling parameters (futures.py brings together those
        that wait side by side): one engine call for all their prompts, left-padded to one width. Returns each
        request's protobuf, or the error that refuses it alone."""
        sampler_id, params = requests[0][0], requests[0][3]
        s = self.samplers.get(sampler_id)
        if s is None:
            raise TinkerUserError(f"no sampling session '{sampler_id}' on this server (create a sampling client first)")
        if s.weights != self.sess.guard.epoch:
            raise TinkerUserError(
                f"sampler {s.model_path or sampler_id} was made on weights the policy has moved past since (an "
                "optim_step, or a session phase: an update, a load, a restore): the engines serve the latest weights "
                "only. Call save_weights_and_get_sampling_client() again")
        results: list = [None] * len(requests)
        good = []
        for i, (_, prompt, n, _) in enumerate(requests):
            try:
                self._check_prompt(prompt, n)
                good.append(i)
            except TinkerUserError as e:
                results[i] = e
        if not good:
            return results
        prompts, counts = [requests[i][1] for i in good], [requests[i][2] for i in good]
        batch, rollout_params = samples.prompt_batch(prompts, counts, params, self.sess.cfg.rollout,
                                                     self.sess.tokenizer)
        with self._phase("sample"):
            self.sess.workers.catch_up(self.sess.step_count)
            out = self.sess.groups["rollout"].call_split(RolloutWorker.generate, batch, rollout_params)
        row = 0
        for i in good:
            n = requests[i][2]
            sequences = [samples.cut(self.sess.tokenizer, out["response_ids_BR"][r], out["response_mask_BR"][r],
                                   out["rollout_logprobs_BR"][r], params.get("stop")) for r in range(row, row + n)]
            self.samples.append(samples.sampled_batch(self.sess.tokenizer, requests[i][1], sequences))
            results[i] = encode_sample(sequences)
            row += n
        return results

    def _check_prompt(self, prompt: list[int], n: int) -> None:
        if not prompt or min(prompt) < 0 or max(prompt) >= self.vocab:
            raise TinkerUserError(f"the prompt must be 1 or more token ids in 0..{self.vocab - 1}")
        if not 1 <= n <= 4096:
            raise TinkerUserError(f"num_samples={n}: ask for 1 to 4096")



def _tokenizer_folder(sess) -> str:
    """A folder AutoTokenizer loads (get_info's tokenizer_id): the model's own, or the run directory's copy
    (the built-in task's model, a GGUF file)."""
    if sess.cfg.model.path and Path(sess.cfg.model.path).is_dir():
        return str(Path(sess.cfg.model.path).resolve())
    out = sess.run_dir / "tokenizer"
    if not out.exists():
        sess.tokenizer.save_pretrained(str(out))
    return str(out.resolve())
