"""Padding-free sequences for the trainer's forward passes, and micro-batches by a token budget.

    rows = pack_sequences(prompt_ids_BP, prompt_mask_BP, response_ids_BR, response_mask_BR)
    hidden = decoder(input_ids=rows.ids_NW, position_ids=rows.positions_NW).last_hidden_state
    h_K = hidden[rows.rows_K, rows.cols_K]        # the states that predict each real response token
    lp_BR = rows.scatter(token_logprobs(h_K))     # back to [B, R], zero on padding

A batch's prompts are left-padded to the longest prompt and its responses right-padded to the longest
response, so a forward over [B, P+R] spends much of its work on padding when lengths vary (44% of the
positions in benchmarks/packing.py's batch). Packing lays each sequence's real tokens end to end in rows of
width W (twice the longest sequence), first-fit by decreasing length, with position ids that restart at 0
for each sequence: transformers reads the restarts as sequence boundaries and attends only within a
sequence (its packed format, used when neither an attention mask nor a KV cache is given), so every token
sees exactly what it saw padded. Rows stay a few sequences wide, not one long row per micro-batch as on
GPUs with varlen flash attention: on a CPU a long row's dense [W, W] attention mask costs more than the
padding it saves (benchmarks/packing.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..config import TrainConfig
from ..data.batch import Batch
from . import distributed as dist_util

# Rows this many times as wide as the longest sequence: wider rows hold more sequences and waste less of
# their tail, but each token attends over the whole row's dense mask (measured at 20M: benchmarks/packing.py)
WIDTH_FACTOR = 2
# train.pack_sequences=auto packs a micro-batch when padding is over this share of its positions: below it the
# padded forward (with its shared prompt prefix) is as fast (benchmarks/packing.py)
AUTO_PADDING_SHARE = 0.25
# the fields pack_sequences reads, in its order
SEQUENCE_FIELDS = ("prompt_ids_BP", "prompt_mask_BP", "response_ids_BR", "response_mask_BR")


@dataclass
class PackedRows:
    ids_NW: torch.Tensor        # token ids, N rows of width W
    positions_NW: torch.Tensor  # 0.. per sequence; a row's unused tail is a sequence of its own (never read)
    rows_K: torch.Tensor        # K = real response tokens, in row-major [B, R] order: the packed row and
    cols_K: torch.Tensor        # column of the hidden state that predicts each one
    mask_BR: torch.Tensor       # bool [B, R]: where those K tokens sit in the padded layout

    def scatter(self, values_K: torch.Tensor) -> torch.Tensor:
        """Values for the K response tokens -> [B, R], zero on padding (differentiable)."""
        out = values_K.new_zeros(self.mask_BR.shape)
        return out.masked_scatter(self.mask_BR, values_K)


def pack_sequences(prompt_ids_BP: torch.Tensor, prompt_mask_BP: torch.Tensor, response_ids_BR: torch.Tensor,
                   response_mask_BR: torch.Tensor, width: int | None = None, pad_id: int = 0) -> PackedRows:
    """Each row's real prompt and response tokens, end to end in rows `width` wide (default: twice the longest
    sequence; never narrower than it)."""
    pm, rm = prompt_mask_BP.bool(), response_mask_BR.bool()
    plen, rlen = pm.sum(1), rm.sum(1)
    if bool(((plen == 0) & (rlen > 0)).any()):
        raise ValueError("a sequence with an empty prompt: its first response token has nothing to be predicted from")
    lengths = plen + rlen
    longest = max(int(lengths.max()) if len(lengths) else 1, 1)
    width = max(width or WIDTH_FACTOR * longest, longest)
    row_of, offset_of, fill = (torch.tensor(x, dtype=torch.long, device=prompt_ids_BP.device)
                               for x in _first_fit(lengths.tolist(), width))
    ids = torch.full((len(fill), width), pad_id, dtype=prompt_ids_BP.dtype, device=prompt_ids_BP.device)
    # a row's unused tail counts 0, 1, ...: a sequence of its own, attended to by nothing that is read
    positions = (torch.arange(width, device=ids.device) - fill[:, None]).clamp(min=0)
    tokens = torch.cat([prompt_ids_BP, response_ids_BR], 1)[torch.cat([pm, rm], 1)]  # real tokens, row-major
    seq = torch.arange(len(lengths), device=ids.device).repeat_interleave(lengths)
    within = torch.arange(len(tokens), device=ids.device) - (torch.cumsum(lengths, 0) - lengths)[seq]
    ids[row_of[seq], offset_of[seq] + within] = tokens
    positions[row_of[seq], offset_of[seq] + within] = within
    # response token j of sequence b is predicted by the state one column before it
    b_K, j_K = rm.nonzero(as_tuple=True)
    rows_K, cols_K = row_of[b_K], offset_of[b_K] + plen[b_K] + j_K - 1
    return PackedRows(ids, positions, rows_K, cols_K, rm)


def _first_fit(lengths: list[int], width: int) -> tuple[list[int], list[int], list[int]]:
    """First-fit by decreasing length: each sequence's row and offset, and how full each row is."""
    row_of, offset_of, fill = [0] * len(lengths), [0] * len(lengths), []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((r for r, used in enumerate(fill) if used + lengths[i] <= width), None)
        if row is None:
            row = len(fill)
            fill.append(0)
        row_of[i], offset_of[i] = row, fill[row]
        fill[row] += lengths[i]
    return row_of, offset_of, fill


def packs(setting: bool | str, prompt_mask_BP: torch.Tensor, response_mask_BR: torch.Tensor) -> bool:
    """Whether a forward over these rows runs packed under train.pack_sequences=`setting`."""
    if setting != "auto":
        return bool(setting)
    positions = prompt_mask_BP.numel() + response_mask_BR.numel()
    real = int(prompt_mask_BP.sum()) + int(response_mask_BR.sum())
    return positions > 0 and 1 - real / positions > AUTO_PADDING_SHARE


def micro_batches(batch: Batch, t: TrainConfig) -> list[Batch]:
    """Consecutive parts of `batch`: at most `t.micro_batch_size` rows each, or, with a token budget
    (`t.max_tokens_per_micro_batch` > 0), as many rows as keep the part's tokens within it: real tokens when
    packing (`t.pack_sequences` true or auto), rows x (P + R) when not. A row longer than the budget is a part
    of its own. The ranks of a sharded role agree on the count (each forward is a collective under FSDP2): one
    with fewer parts splits its rows into as many."""
    budget, packed = t.max_tokens_per_micro_batch, t.pack_sequences
    parts = _by_tokens(batch, budget, packed) if budget > 0 and len(batch) else batch.split(t.micro_batch_size)
    count = int(dist_util.all_reduce_max(torch.tensor(len(parts))))
    return parts if count == len(parts) else batch.chunk(count)


def _by_tokens(batch: Batch, max_tokens: int, packed: bool | str) -> list[Batch]:
    if packed:
        cost = (batch["prompt_mask_BP"].sum(1) + batch["response_mask_BR"].sum(1)).tolist()
    else:
        cost = [batch["prompt_ids_BP"].shape[1] + batch["response_ids_BR"].shape[1]] * len(batch)
    parts, start, used = [], 0, 0
    for i, c in enumerate(cost):
        if i > start and used + c > max_tokens:
            parts.append(batch.slice(start, i))
            start, used = i, 0
        used += c
    parts.append(batch.slice(start, len(batch)))
    return parts
