"""The Tinker API's two training calls on a policy worker: `forward_backward` (gradients accumulate, no step) and
`optim_step` (one AdamW step with the request's hyperparameters). `rlbench_nb/serve/` sends them; the session's
own `update` (roles/trainer.py) is untouched by them.

A datum batch holds one Tinker datum a row, right-padded to T tokens:

    input_ids_BT, input_mask_BT    model_input
    target_ids_BT                  target_tokens: the token scored at each input position
    weights_BT, logprobs_BT, advantages_BT    the loss's inputs (algos/tinker_losses.py), zero past each datum

Through the scorer (its chunked head, FSDP2 root): the datum is a one-token "prompt" (x0) followed by a "response"
(x1 .. x_{N-1}, then one slot that is never an input), scored at `target_ids_BT` instead of its next tokens, at
temperature 1 (Tinker's training log-probs are the model's own distribution).
"""
from __future__ import annotations

import math

import torch

from ..algos.tinker_losses import tinker_loss
from ..data.batch import Batch
from . import distributed as dist_util
from .trainer import _check_finite_weights, adam_steps

LOSS_INPUTS = {"weights": "weights_BT", "logprobs": "logprobs_BT", "advantages": "advantages_BT"}


class GradientsDropped(RuntimeError):
    """A Tinker training call failed, or found its gradients gone: what had accumulated since the last optim_step
    was dropped (nothing was applied). The message says why and what to do."""


class NonFiniteGradient(FloatingPointError):
    """optim_step's accumulated gradient is not finite: the step was skipped, the weights are as they were."""


def _datum_logprobs(worker, mb: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    d = worker.device
    ids, mask = mb["input_ids_BT"].to(d), mb["input_mask_BT"].to(d)
    response = torch.cat([ids[:, 1:], ids.new_zeros((len(ids), 1))], dim=1)
    lp, _ = worker.scorer(ids[:, :1], mask[:, :1], response, mask, with_entropy=False,
                          targets_BR=mb["target_ids_BT"].to(d))
    return lp, mask.float()


def forward_backward(worker, batch: Batch, loss_fn: str, loss_cfg: dict, forward_only: bool) -> dict:
    """Per datum (this rank's rows, in order): the log-probs of its targets and its per-token loss; and the loss's
    sum. The gradient of that sum is added to what earlier calls left (Tinker's semantics: `optim_step` applies
    and clears it). A non-finite loss adds nothing: the gradients accumulated since the last step are dropped
    too (they would be mixed with a broken batch's) and the error says so."""
    scorer, world = worker.scorer, dist_util.world_size()
    saved = scorer.temperature, scorer.pack
    scorer.temperature, scorer.pack = 1.0, False
    # FSDP2's backward is a collective: every rank runs the same number of passes, so one pass a shard
    parts = [batch] if worker.sharded else batch.split(worker.cfg.train.micro_batch_size)
    logprobs, losses, total = [], [], 0.0
    try:
        for mb in parts:  # a failure part-way drops every gradient since the last step: none is left half-added
            with torch.set_grad_enabled(not forward_only):
                lp, mask = _datum_logprobs(worker, mb)
                inputs = {k: mb[v].to(lp.device) for k, v in LOSS_INPUTS.items() if v in mb}
                elementwise = tinker_loss(loss_fn, lp, inputs, mask, loss_cfg)
                loss = elementwise.sum()
            if not forward_only:
                if dist_util.all_reduce_sum(torch.tensor(0.0 if torch.isfinite(loss) else 1.0)) > 0:
                    raise GradientsDropped(
                        f"the {loss_fn} loss is not finite on this batch (check its logprobs and advantages for "
                        "inf/NaN): nothing was applied, and the gradients accumulated since the last optim_step "
                        "were dropped; send this step's data again")
                (loss * world).backward()
            total += float(loss.detach())
            logprobs.append(lp.detach().float().cpu())
            losses.append(elementwise.detach().float().cpu())
    except BaseException:
        if not forward_only:
            worker.optimizer.zero_grad(set_to_none=True)
        raise
    finally:
        scorer.temperature, scorer.pack = saved
    lengths = batch["input_mask_BT"].sum(-1).tolist()
    rows = [(lp_T, el_T) for part_lp, part_el in zip(logprobs, losses) for lp_T, el_T in zip(part_lp, part_el)]
    return {"logprobs": [lp[:n] for (lp, _), n in zip(rows, lengths)],
            "elementwise_loss": [el[:n] for (_, el), n in zip(rows, lengths)], "loss_sum": total}


def zero_grad(worker) -> None:
    worker.optimizer.zero_grad(set_to_none=True)


def optim_step(worker, adam: dict, expect_gradients: bool) -> dict:
    """One AdamW step on the accumulated gradients with the request's learning rate, betas, eps and decoupled
    weight decay, clipped to `grad_clip_norm` when it is above 0; then the gradients are cleared. The optimizer's
    own settings (the session's train.*) are put back afterwards: a Tinker client never changes the session's.
    `expect_gradients`: a forward_backward came before; finding none means something cleared them."""
    params = [p for p in worker.model.parameters() if p.requires_grad]
    if expect_gradients and all(p.grad is None for p in params):
        raise GradientsDropped("the gradients of this client's forward_backward are gone (a session phase cleared "
                               "them: an update, a load, a restore): nothing was applied; send the step's data again")
    groups = worker.optimizer.param_groups
    saved = [{k: g[k] for k in ("lr", "betas", "eps", "weight_decay")} for g in groups]
    for g in groups:
        g.update(lr=adam["learning_rate"], betas=(adam["beta1"], adam["beta2"]), eps=adam["eps"],
                 weight_decay=adam["weight_decay"])
    try:
        clip = adam["grad_clip_norm"] if adam["grad_clip_norm"] > 0 else math.inf
        grad_norm = dist_util.local_scalar(torch.nn.utils.clip_grad_norm_(params, clip))
        if not math.isfinite(grad_norm):
            worker.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteGradient(f"the accumulated gradient's norm is {grad_norm}: the step was skipped and the "
                                    "gradients dropped (a loss input with inf/NaN, or a learning rate too high)")
        worker.optimizer.step()
        _check_finite_weights(worker.model, worker.optimizer, grad_norm)
        worker.optimizer.zero_grad(set_to_none=True)
    finally:
        for g, s in zip(groups, saved):
            g.update(s)
    return {"grad_norm": grad_norm, "adam_steps": adam_steps(worker.model, worker.optimizer)}
