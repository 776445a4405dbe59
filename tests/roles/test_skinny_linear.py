"""The rollout engine's linear layers for decode-sized batches (roles/rollout/skinny_linear.py): the same
numbers as F.linear at every row count (padded or not, with a bias or not), F.linear's own path where autograd
or many rows need it, and only plain fp32 layers patched.

Tolerance: the two forms add the same products in another order; fp32 sums of 1536 terms of order 1 differ
by ~1e-5 at most on any CPU's vector width, a wrong row or a missing bias by ~1."""
import torch

from rlbench_nb.roles.rollout.skinny_linear import MAX_ROWS, columns, takes_columns, times_columns, use_skinny_linears


def test_skinny_linear_matches_f_linear_at_every_row_count():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(192, 1536), torch.nn.Linear(1536, 192, bias=False))
    model.add_module("bf16", torch.nn.Linear(1024, 1024).to(torch.bfloat16))
    model.add_module("small", torch.nn.Linear(128, 256))  # in the CPU's cache: F.linear is as fast
    assert use_skinny_linears(model) == 2 and "forward" not in vars(model.bf16) and "forward" not in vars(model.small)
    for rows in (1, 3, 5, 13, 15, 16, 17, 31, MAX_ROWS, MAX_ROWS + 1):  # unpadded, padded, F.linear's
        x = torch.randn(rows, 1, 192)
        with torch.no_grad():
            ours = model[1](model[0](x))
            ref = torch.nn.functional.linear(torch.nn.functional.linear(x, model[0].weight, model[0].bias),
                                             model[1].weight)
        assert ours.shape == ref.shape == (rows, 1, 192)
        assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-5), (rows, (ours - ref).abs().max())
        # the form the decode step shares between linears, against W @ x^T written out here (rows padded with
        # zeros to a multiple of 16 from 5 on, the padding's outputs dropped, the bias added): the same numbers
        with torch.no_grad():
            if takes_columns(rows):
                x2 = x.reshape(rows, 192)
                padded = torch.cat([x2, x2.new_zeros(-rows % 16 if rows >= 5 else 0, 192)])
                by_hand = torch.mm(model[0].weight, padded.t()).t()[:rows] + model[0].bias
                assert torch.equal(times_columns(model[0], columns(x2), rows), by_hand)
    x = torch.randn(4, 192, requires_grad=True)  # with autograd: F.linear's path, gradients as ever
    model[0](x).sum().backward()
    assert torch.allclose(x.grad, model[0].weight.sum(0).expand(4, -1), atol=1e-5)
