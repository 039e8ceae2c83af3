"""Layers whose CPU fast paths must not change the math."""

import pytest
import torch
import torch.nn.functional as F

from nanoengine.layers.linear import CPU_FEW_ROWS, cpu_padded_rows, linear


@pytest.mark.parametrize("rows", [*range(1, CPU_FEW_ROWS + 2), 64])
def test_linear_matches_f_linear_for_every_row_count(rows):
    torch.manual_seed(rows)
    x, weight, bias = torch.randn(rows, 96), torch.randn(40, 96), torch.randn(40)
    out = linear(x, weight, bias)
    assert out.shape == (rows, 40) and out.is_contiguous()
    torch.testing.assert_close(out, F.linear(x, weight, bias))


def test_padded_row_counts():
    assert [cpu_padded_rows(n) for n in (1, 2, 7, 8, 9, 16, 17, 31, 32)] == [2, 2, 7, 8, 16, 16, 24, 32, 32]
