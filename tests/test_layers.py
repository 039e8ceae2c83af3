"""Layers whose CPU fast paths must not change the math."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.layers.linear import can_pack_for_onednn, linear, pack_weights_for_onednn

needs_onednn = pytest.mark.skipif(not can_pack_for_onednn(torch.empty(1)), reason="this torch build has no oneDNN")


class TwoLinears(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.first, self.second = nn.Linear(96, 40, dtype=dtype), nn.Linear(40, 8, bias=False, dtype=dtype)
        self.first.packed_weight = self.second.packed_weight = None


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 8, 9, 31, 32, 33, 300])
def test_onednn_linear_matches_f_linear(rows):
    torch.manual_seed(rows)
    model = TwoLinears(torch.float32)
    pack_weights_for_onednn(model)
    x = torch.randn(rows, 96)
    # The second layer's input is a non-contiguous view.
    for layer, inputs in ((model.first, x), (model.second, x[:, :40])):
        assert layer.packed_weight is not None
        out = linear(inputs, layer.weight, layer.bias, layer.packed_weight)
        assert out.shape == (rows, layer.out_features)
        torch.testing.assert_close(out, F.linear(inputs, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not can_pack_for_onednn(torch.empty(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 here")
def test_onednn_linear_bfloat16():
    torch.manual_seed(0)
    model = TwoLinears(torch.bfloat16)
    pack_weights_for_onednn(model)
    x = torch.randn(17, 96, dtype=torch.bfloat16)
    out = linear(x, model.first.weight, model.first.bias, model.first.packed_weight)
    torch.testing.assert_close(out, F.linear(x, model.first.weight, model.first.bias), rtol=2e-2, atol=2e-2)


def test_weights_that_onednn_cannot_take_stay_unpacked():
    model = TwoLinears(torch.float16)
    pack_weights_for_onednn(model)
    assert model.first.packed_weight is None and model.second.packed_weight is None
