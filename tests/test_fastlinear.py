"""The weight-major linear computes the same product as nn.Linear, for every row count."""
import pytest
import torch

from batchspec import fastlinear


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 16, 17, 40])
def test_weight_major_matches_linear(rows):
    torch.manual_seed(rows)
    linear = torch.nn.Linear(24, 40)
    x = torch.randn(1, rows, 24)
    expected = linear(x)
    fastlinear.patch_linears(linear)
    got = linear(x)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # views downstream (as attention does) need a contiguous result
    got.view(1, rows, 4, 10)


def test_patch_covers_every_linear_and_keeps_gradients():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(),
                                torch.nn.Linear(8, 3, bias=False))
    assert fastlinear.patch_linears(model) == 2
    x = torch.randn(2, 8, requires_grad=True)
    model(x).sum().backward()
    assert x.grad is not None and model[0].weight.grad is not None
