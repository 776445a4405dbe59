"""The next token: the distribution the rollout samples from (temperature, top-k, top-p) and one draw from it.

`sample_next` is the HF engine's (and its multi-turn episodes') sampler. The log-prob it returns for a token is
the one the trainer computes for it, under softmax(logits / T), not under the top-k / top-p truncated and
renormalised distribution it was drawn from: every consumer compares the two (the mismatch monitor, algo.rollout_is,
async steps' old log-probs), and a truncated one differs on every token by the log of the kept mass (top_p=0.9:
~0.1 a token; MIS then rejected every sequence and the alarm fired each step). The truncation is a sampling
bias the loss does not model, as in TRL and verl; RL usually samples with top_p=1 and top_k=0, the defaults.

`draw` is an inverse-CDF draw: one uniform per row, placed on the running sum of the probabilities.
`torch.multinomial` instead draws an exponential per vocabulary entry, and a CPU generator makes ~50 M of them a
second: at SmolLM2's 49152 entries and 16 rows that was 16 ms, 11% of a decode step (2-core EPYC). A plain
cumulative sum over the whole vocabulary in float64 costs ~4-13 ms as well, so the sum runs in two levels:
blocks of `BLOCK` entries are summed (vectorised), the uniform picks a block, and only that block is summed
entry by entry. All sums are float64, so a token's chance is its probability to ~1e-15.
"""
from __future__ import annotations

import torch

from ...config import RolloutConfig

BLOCK = 1024  # a vocabulary of up to one block draws with torch.multinomial: there its per-entry cost is small
BELOW = 1 - 2 ** -40  # a total times this is below it, whatever float64 rounding did to the sums


def sample_next(logits_BV: torch.Tensor, p: RolloutConfig,
                gen: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens drawn (from `gen`, or torch's RNG) from softmax(logits / T) restricted by top-k, then top-p
    (greedy when T == 0), and their log-probs under softmax(logits / T) before the restriction (the plain
    softmax when greedy): what the trainer computes for them."""
    if p.temperature == 0:
        tok = logits_BV.argmax(-1)
        return tok, logits_BV.log_softmax(-1).gather(-1, tok[:, None]).squeeze(-1)
    scores = logits_BV / p.temperature if p.temperature != 1 else logits_BV
    untruncated = scores
    if p.top_k and p.top_k < scores.shape[-1]:
        kth = scores.topk(p.top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if p.top_p < 1:  # drop the low tail whose total mass is <= 1 - top_p; the top token always stays
        sorted_scores, order = scores.sort(dim=-1)
        tail = sorted_scores.softmax(-1).cumsum(-1) <= 1 - p.top_p
        tail[:, -1] = False
        scores = scores.masked_fill(tail.scatter(-1, order, tail), float("-inf"))
    logp = scores.log_softmax(-1)
    tok = draw(logp.exp(), gen)
    if scores is not untruncated:
        logp = untruncated.log_softmax(-1)
    return tok, logp.gather(-1, tok[:, None]).squeeze(-1)


def draw(probs_BV: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """One index per row, index i with chance probs[i] / sum(probs) (rows need not sum to 1); an entry of
    probability zero is never drawn."""
    B, V = probs_BV.shape
    if V <= BLOCK:
        return torch.multinomial(probs_BV, 1, generator=gen).squeeze(-1)
    blocks = -(-V // BLOCK)
    padded = torch.nn.functional.pad(probs_BV, (0, blocks * BLOCK - V)).view(B, blocks, BLOCK)
    cum = padded.sum(-1, dtype=torch.float64).cumsum(-1)                        # [B, blocks]
    # below the total: rounding must not put u at the very end, past the last entry with mass
    u = torch.rand((B, 1), generator=gen, dtype=torch.float64, device=probs_BV.device) * (cum[:, -1:] * BELOW)
    block = torch.searchsorted(cum, u, right=True).clamp_(max=blocks - 1)       # first block whose sum passes u
    before = torch.nn.functional.pad(cum, (1, 0)).gather(1, block)              # the sum of the blocks before it
    within = padded[torch.arange(B, device=probs_BV.device), block[:, 0]].cumsum(-1, dtype=torch.float64)
    # u - before >= 0 and, capped below the block's own total, it lands on an entry whose probability is > 0
    # (the block totals and `within` add in different orders, so their last bits may differ)
    target = torch.minimum(u - before, within[:, -1:] * BELOW)
    return block[:, 0] * BLOCK + torch.searchsorted(within, target, right=True)[:, 0]
