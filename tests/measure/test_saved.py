"""SavedTensorMeter: bytes of distinct non-parameter storages saved for backward."""

from __future__ import annotations

import torch

from torchtrace.measure.saved import SavedTensorMeter


def test_counts_each_storage_once_and_excludes_parameters():
    lin = torch.nn.Linear(4, 3)
    x = torch.randn(5, 4, requires_grad=True)
    with SavedTensorMeter(lin.parameters()) as meter:
        h = torch.tanh(lin(x))  # Linear saves x (and its weight: excluded); tanh saves h
        y = (h * h).sum()  # mul saves h twice: the same storage, counted once
    assert meter.bytes == 4 * (5 * 4 + 5 * 3) and meter.tensors == 2
    y.backward()  # the hooks return the tensors unchanged: gradients are the plain ones
    ref = torch.autograd.grad((torch.tanh(lin(x)) ** 2).sum(), x)[0]
    torch.testing.assert_close(x.grad, ref)


def test_a_view_counts_its_whole_storage_and_nothing_is_counted_outside():
    big = torch.randn(100, requires_grad=True)
    with SavedTensorMeter() as meter:
        part = big[:10].exp()  # exp saves its output: a fresh 10-element storage
        big[:10].sin()  # sin saves its input: a view keeping all 100 elements of big alive
    assert meter.bytes == 4 * 10 + 4 * 100
    torch.tanh(big)  # outside: not counted
    assert meter.bytes == 440 and part.shape == (10,)
