"""The rollout's draw of the next token (roles/rollout/sampling.py): the two-level inverse-CDF draw must pick
each index with its probability and never one of probability zero, wherever the mass sits (block edges, the
first and last entries, a vocabulary that is no multiple of the block)."""
import torch

from rlbench_nb.config import RolloutConfig
from rlbench_nb.roles.rollout.sampling import BLOCK, draw, sample_next


def _frequencies(probs_V: torch.Tensor, draws: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    picked = torch.cat([draw(probs_V.expand(2000, -1), gen) for _ in range(draws // 2000)])
    return torch.bincount(picked, minlength=len(probs_V)).double() / len(picked)


def test_draw_picks_each_index_with_its_probability():
    V = 2 * BLOCK + 300  # three blocks, the last one short
    probs = torch.zeros(V)
    probs[[0, 5, BLOCK - 1, BLOCK, 2 * BLOCK + 7, V - 1]] = torch.tensor([0.05, 0.4, 0.15, 0.1, 0.2, 0.1])
    probs *= 7  # rows need not sum to one
    n = 40_000
    freq = _frequencies(probs, n)
    p = (probs / probs.sum()).double()
    assert freq[p == 0].sum() == 0  # never an entry of probability zero
    # a binomial count's standard deviation is sqrt(n p (1-p)); 5 of them fail a fair draw ~1 time in 10^6 per
    # entry, and a draw off by one position (the wrong side of a block edge) moves whole probabilities
    sigma = (p * (1 - p) / n).sqrt()
    assert torch.all((freq - p).abs() <= 5 * sigma + 1e-12), torch.stack([freq, p])[:, p > 0]


def test_draw_with_all_mass_on_one_entry_and_uniform_rows():
    V = 3 * BLOCK
    for i in (0, BLOCK - 1, BLOCK, V - 1):
        one = torch.zeros(4, V)
        one[:, i] = 1e-30  # tiny, yet the only mass
        assert torch.equal(draw(one, torch.Generator().manual_seed(i)), torch.full((4,), i))
    freq = _frequencies(torch.ones(100), 20_000, seed=1)
    assert freq.min() > 0.0065 and freq.max() < 0.0135  # 1% each; 5 sigma is 0.35%


def test_sample_next_is_seeded_and_records_the_trainers_log_prob_of_a_truncated_draw():
    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(0))
    p = RolloutConfig(temperature=0.7, top_k=50, top_p=0.9)
    a = sample_next(logits, p, torch.Generator().manual_seed(3))
    b = sample_next(logits, p, torch.Generator().manual_seed(3))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    # the token is inside the top 50, and its log-prob is the trainer's: softmax(logits / T) over the whole
    # vocabulary, not the truncated distribution renormalised (higher by the log of the kept mass, every token)
    assert torch.all(logits.gather(1, a[0][:, None]) >= logits.topk(50, dim=-1).values[:, -1:])
    full = (logits / 0.7).log_softmax(-1).gather(1, a[0][:, None]).squeeze(1)
    torch.testing.assert_close(a[1], full, atol=0, rtol=0)
    untruncated = sample_next(logits, RolloutConfig(temperature=0.7), torch.Generator().manual_seed(3))
    torch.testing.assert_close(untruncated[1], (logits / 0.7).log_softmax(-1).gather(1, untruncated[0][:, None])
                               .squeeze(1), atol=0, rtol=0)
