"""HF rollout engine: the recorded log-probs are those of the distribution the sampler drew from
(after temperature, top-k and top-p), taken one step at a time."""
from __future__ import annotations

import torch

import rlbench_nb as rl


def _generate(sess, **params):
    probe = sess._encode(sess.test_data.rows[:8], 4, "probe")
    return sess.groups["rollout"].call_split("generate", probe, sess.cfg.rollout.model_copy(update=params))


def test_truncated_sampling_records_the_truncated_distribution(small_cfg):
    sess = rl.Session(small_cfg("run.tensorboard=false"))
    greedy = _generate(sess, temperature=0.0)
    for params in ({"top_k": 1, "temperature": 1.5}, {"top_p": 1e-6, "temperature": 0.7}):
        out = _generate(sess, **params)  # one token left in the support: it is the greedy one, with log p = 0
        assert torch.equal(out["response_ids_BR"], greedy["response_ids_BR"]), params
        m = out["response_mask_BR"].bool()
        assert torch.all(out["rollout_logprobs_BR"][m].abs() < 1e-6), params
    # top-k = 2: each sampled token had probability >= 1/2 or was the runner-up; log p is finite and
    # at least as high as under the full distribution at the same temperature
    torch.manual_seed(0)
    k2 = _generate(sess, top_k=2, temperature=1.0)
    m = k2["response_mask_BR"].bool()
    k2.update(sess._encode(sess.test_data.rows[:8], 4, "probe"))
    full = sess.groups["policy"].call_split("compute_logprobs", k2)["old_logprobs_BR"]
    assert torch.all(torch.isfinite(k2["rollout_logprobs_BR"][m]))
    assert torch.all(k2["rollout_logprobs_BR"][m] >= full[m] - 1e-5)
    assert torch.any(k2["rollout_logprobs_BR"][m] > full[m] + 1e-3)  # renormalised over 2 tokens
    sess.close()
