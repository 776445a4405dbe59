"""`Batch`: the one container that flows through rollout -> score -> prepare -> update.

Tensors share the first dimension B (one row per sampled response); non-tensor fields (prompt text,
answers, reward errors) ride along as lists of length B. A batch splits by data-parallel rank or
micro-batch and concatenates back. Phases never change the batch they are given: they return a new one
(`replace`) that shares the tensors they did not touch.

    b = Batch({"x_B": torch.arange(4)}, {"prompt": list("abcd")})
    left, right = b.chunk(2)
    assert Batch.cat([left, right])["prompt"] == list("abcd")

Shape suffixes, one letter per axis, used the same way across the package (`algos/`, `roles/`, `ops/`):

    B  rows of a batch: one sampled response each (prompts x rollout.n)
    P  prompt tokens, left-padded
    R  response tokens, right-padded (the axis of log-probs, advantages, values, masks)
    T  whole-sequence tokens, P + R
    V  vocabulary

`batch.info` holds batch-level facts, not rows; every key, who writes it and who reads it
(tests/data/test_batch.py checks that the code uses no other):

    row_fields      prompts.encode, rundir.load_rollouts   the dataset row's own fields riding along (answer, ...):
                                                           reward workers pass them on, tables show them
    tag             prompts.encode                         the draw's name (`s<step>`): the engine's rewind finds it
    source          rundir.load_rollouts                   the rollouts file a batch was read from
    step            Session.rollout                        the step that generated the batch
    metrics         each phase                             the step's metrics so far; update writes them out
    values_epoch    phase_calls.score                      the weights the critic's values came from (guard.epoch):
                                                           prepare reuses them only while they are the same
    logprobs_epoch  phase_calls.prepare                    the same for old log-probs left to the update's forward
    kl_current      phase_calls.prepare                    the measured KL the KL controller moves by, in update
    off_policy      runner (async steps)                   generated one step or more earlier: the engine's log-probs
                                                           are the old ones
    wall_start      runner (async steps)                   when the step began, for time/step_s and idle shares
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape
from typing import Any

import torch

# What people see (the batch's table, rollout files, the inspector) -> the batch field it comes from, in
# this order. Dataset row fields (e.g. `answer`) are shown under their own names after `response`.
SHOWN_FIELDS = {"prompt": "prompt", "response": "response", "reward": "scores_B",
                "reward_before": "scores_before_B", "advantage": "advantage", "length": "response_len_B",
                "reward_error": "reward_error", "reward_model": "rm_scores_B", "reward_rule": "rule_scores_B",
                "turns": "num_turns_B", "tool_calls": "tool_calls_B", "env_error": "env_error",
                "reward_parts": "reward_parts"}


class Batch:
    def __init__(self, tensors: dict[str, torch.Tensor] | None = None, meta: dict[str, list] | None = None,
                 info: dict[str, Any] | None = None):
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.meta: dict[str, list] = {k: list(v) for k, v in (meta or {}).items()}
        self.info: dict[str, Any] = dict(info or {})  # batch-level facts (the table above)
        self._check()

    # ---- pickling (how a batch travels to and from Ray actors) -----------------------------------
    def __getstate__(self) -> dict:
        # CPU tensors travel as numpy arrays (`_as_array`): Ray ships each out of band, a channel pickles its
        # bytes at once (a tensor's own pickling goes through torch.save: ~35 µs each way, 9 tensors a step's
        # update), and a slice sends its own rows, not the whole storage it views
        arrays = {k: _as_array(v) for k, v in self.tensors.items()}
        return {"order": list(self.tensors), "arrays": {k: a for k, a in arrays.items() if a is not None},
                "other": {k: v for k, v in self.tensors.items() if arrays[k] is None},  # pickled as tensors
                "meta": self.meta, "info": self.info}

    def __setstate__(self, state: dict) -> None:
        tensors = {k: _from_array(a) for k, a in state["arrays"].items()} | state["other"]
        self.tensors = {k: tensors[k] for k in state["order"]}
        self.meta, self.info = state["meta"], state["info"]

    def _check(self) -> None:
        sizes = {k: v.shape[0] for k, v in self.tensors.items()} | {k: len(v) for k, v in self.meta.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"batch fields disagree on the batch size: {sizes}")

    def __len__(self) -> int:
        for v in self.tensors.values():
            return v.shape[0]
        for v in self.meta.values():
            return len(v)
        return 0

    def __contains__(self, key: str) -> bool:
        return key in self.tensors or key in self.meta

    def __getitem__(self, key: str):
        if key in self.tensors:
            return self.tensors[key]
        if key in self.meta:
            return self.meta[key]
        raise KeyError(f"batch has no field '{key}'; it has {self.keys()}")

    def __setitem__(self, key: str, value) -> None:
        if torch.is_tensor(value):
            self.meta.pop(key, None)
            self.tensors[key] = value
        else:
            self.tensors.pop(key, None)
            self.meta[key] = list(value)
        self._check()

    def get(self, key: str, default=None):
        return self[key] if key in self else default

    def keys(self) -> list[str]:
        return list(self.tensors) + list(self.meta)

    def only(self, *keys: str) -> Batch:
        """The same rows with just these fields (and the info): what a worker needs, not all the batch."""
        return Batch({k: v for k, v in self.tensors.items() if k in keys},
                     {k: v for k, v in self.meta.items() if k in keys}, self.info)

    # ---- split / join ---------------------------------------------------------------------------
    def select(self, index: Sequence[int] | torch.Tensor) -> Batch:
        idx = torch.as_tensor(index, dtype=torch.long)
        ids = idx.tolist()
        return Batch({k: v[idx] for k, v in self.tensors.items()},
                     {k: [v[i] for i in ids] for k, v in self.meta.items()}, self.info)

    def slice(self, start: int, stop: int) -> Batch:
        return Batch({k: v[start:stop] for k, v in self.tensors.items()},
                     {k: v[start:stop] for k, v in self.meta.items()}, self.info)

    def chunk(self, n: int) -> list[Batch]:
        """n contiguous parts whose sizes differ by at most one (the first ones larger)."""
        size, extra = divmod(len(self), n)
        bounds, start = [], 0
        for i in range(n):
            stop = start + size + (1 if i < extra else 0)
            bounds.append((start, stop))
            start = stop
        return [self.slice(a, b) for a, b in bounds]

    def split(self, size: int) -> list[Batch]:
        """Consecutive parts of at most `size` rows."""
        return [self.slice(i, min(i + size, len(self))) for i in range(0, len(self), size)]

    @staticmethod
    def cat(batches: Iterable[Batch]) -> Batch:
        batches = [b for b in batches if len(b) or b.keys()]
        if not batches:
            return Batch()
        first = batches[0]
        for b in batches[1:]:
            if set(b.keys()) != set(first.keys()):
                raise ValueError(f"cannot concatenate batches with different fields: {first.keys()} vs {b.keys()}")
        tensors = {k: torch.cat([b.tensors[k] for b in batches]) for k in first.tensors}
        meta = {k: [x for b in batches for x in b.meta[k]] for k in first.meta}
        return Batch(tensors, meta, first.info)

    def update(self, other: Batch | dict) -> Batch:
        """Add or replace fields in place from another batch or dict of the same length; returns self."""
        items = other.tensors | other.meta if isinstance(other, Batch) else other
        for k, v in items.items():
            self[k] = v
        return self

    def replace(self, fields: Batch | dict | None = None, /, **more) -> Batch:
        """A new batch with these fields added or replaced, leaving this one as it was. Untouched tensors
        are shared, not copied; `info` is copied a level deep (its `metrics` dict included)."""
        out = Batch(self.tensors, self.meta, {k: dict(v) if isinstance(v, dict) else v for k, v in self.info.items()})
        out.update(fields or {})
        return out.update(more)

    def to(self, device) -> Batch:
        return Batch({k: v.to(device) for k, v in self.tensors.items()}, self.meta, self.info)

    # ---- looking at it --------------------------------------------------------------------------
    def shown_fields(self) -> dict[str, str]:
        """{shown name: batch field} for what this batch has: `SHOWN_FIELDS`, with the dataset row's fields
        (`info["row_fields"]`) after the response."""
        shown = {k: v for k, v in SHOWN_FIELDS.items() if v in self}
        extra = {k: k for k in self.info.get("row_fields", ()) if k in self.meta and k not in shown}
        order = ["prompt", "response", *extra, *[k for k in shown if k not in ("prompt", "response")]]
        return {k: (extra | shown)[k] for k in order if k in extra or k in shown}

    def rows(self, fields: dict[str, str] | Sequence[str] | None = None) -> list[dict]:
        """One dict per sample, keyed by the names people see (`shown_fields`) or by `fields` (a list of
        batch fields, or {name: field}); one-element tensors become numbers."""
        fields = (self.shown_fields() if fields is None
                  else fields if isinstance(fields, dict) else {f: f for f in fields})
        out = []
        for i in range(len(self)):
            row = {}
            for name, f in fields.items():
                v = self[f][i]
                row[name] = v.item() if torch.is_tensor(v) and v.numel() == 1 else v
            out.append(row)
        return out

    def _summary(self) -> str:
        shapes = ", ".join(f"{k}{tuple(v.shape)}" for k, v in self.tensors.items())
        return f"Batch({len(self)} rows; tensors: {shapes}; fields: {', '.join(self.meta)})"

    def __repr__(self) -> str:
        lines = [self._summary()]
        for row in self.rows()[:8]:
            lines.append("  " + "  ".join(f"{k}={_short(v)}" for k, v in row.items()))
        if len(self) > 8:
            lines.append(f"  ... {len(self) - 8} more")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        rows = self.rows()[:20]
        if not rows:
            return f"<code>{escape(self._summary())}</code>"
        head = "".join(f"<th>{escape(k)}</th>" for k in rows[0])
        body = "".join("<tr>" + "".join(f"<td>{escape(_short(v, 60))}</td>" for v in r.values()) + "</tr>"
                       for r in rows)
        more = f"<div>… {len(self) - 20} more rows</div>" if len(self) > 20 else ""
        return (f"<div><code>{escape(self._summary())}</code><table style='font-size:12px'>"
                f"<tr>{head}</tr>{body}</table>{more}</div>")


def _short(v, width: int = 24) -> str:
    s = f"{v:.3g}" if isinstance(v, float) else repr(v) if isinstance(v, str) else str(v)
    return s if len(s) <= width else s[: width - 1] + "…"



def trained_tokens(batch: Batch) -> torch.Tensor:
    """The response tokens losses, KL, entropy and the mismatch are taken over: the model's own tokens
    (`loss_mask_BR`, set by multi-turn episodes, where environment tokens sit between the model's turns), else
    every response token (`response_mask_BR`, which also stays the attention mask and marks where a sequence
    ends); less the sequences `algo.rollout_is=mis` rejected (weight 0): out of the loss and its denominators,
    as verl's rejection mask (kept in, they shrank every other sequence's share and still took entropy and KL
    gradients)."""
    mask = batch["loss_mask_BR"] if "loss_mask_BR" in batch else batch["response_mask_BR"]
    if "is_weights_BR" in batch:  # tis weights are > 0 on every token; mis weights 0 on a rejected sequence
        mask = mask * (batch["is_weights_BR"] > 0)
    return mask


def minibatch_major(batch: Batch, n_mini: int, world: int) -> Batch:
    """Reorder rows so that splitting by rank, then each rank splitting into `n_mini` mini-batches, puts
    the rows of global mini-batch j on the ranks' j-th mini-batches: any number of ranks then takes
    the same optimizer steps on the same data."""
    if world == 1:
        return batch
    parts = [mini.chunk(world) for mini in batch.chunk(n_mini)]
    return Batch.cat([parts[j][r] for r in range(world) for j in range(n_mini)])


def _as_array(t: torch.Tensor):
    """A CPU tensor as a numpy array of its values, or (dtype, shape, bytes) for a dtype numpy lacks (bfloat16);
    None for what must pickle as a tensor (autograd, another device, a sparse layout)."""
    if t.device.type != "cpu" or t.requires_grad or t.layout != torch.strided:
        return None
    try:
        return t.resolve_conj().resolve_neg().numpy()
    except TypeError:  # bfloat16, float8: the same bytes as unsigned integers of its width
        flat = t.contiguous().reshape(-1)
        return str(t.dtype).removeprefix("torch."), tuple(t.shape), flat.view(torch.uint8).numpy()


def _from_array(a) -> torch.Tensor:
    """`_as_array`'s value back as a tensor that owns writable memory (an array mapped read-only from Ray's
    object store is copied: batches are written to)."""
    if isinstance(a, tuple):
        dtype, shape, a = a
        return _from_array(a).view(getattr(torch, dtype)).reshape(shape)
    return torch.from_numpy(a if a.flags.writeable else a.copy())
