"""Layers whose CPU fast paths must not change the math."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.layers import linear as linear_module
from nanoengine.layers.linear import can_pack_for_onednn, choose_linear_kernels, linear

needs_onednn = pytest.mark.skipif(not can_pack_for_onednn(torch.empty(1)), reason="this torch build has no oneDNN")


class TwoLinears(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.first, self.second = nn.Linear(96, 40, dtype=dtype), nn.Linear(40, 8, bias=False, dtype=dtype)
        self.first.packed_weight = self.second.packed_weight = None


def assert_linears_match_f_linear(model: TwoLinears, rows: int, tolerance: float = 1e-5) -> None:
    x = torch.randn(rows, 96, dtype=model.first.weight.dtype)
    # The second layer's input is a non-contiguous view.
    for layer, inputs in ((model.first, x), (model.second, x[:, :40])):
        out = linear(inputs, layer.weight, layer.bias, layer.packed_weight)
        assert out.shape == (rows, layer.out_features)
        torch.testing.assert_close(out, F.linear(inputs, layer.weight, layer.bias), rtol=tolerance, atol=tolerance)


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 8, 9, 16, 17, 31, 32, 33, 64, 65, 300])
@pytest.mark.parametrize("kernel", ["onednn", "torch", "auto"])
def test_every_linear_kernel_choice_matches_f_linear(kernel, rows, monkeypatch, tmp_path):
    monkeypatch.setenv("NANOENGINE_CACHE", str(tmp_path))
    torch.manual_seed(rows)
    model = TwoLinears(torch.float32)
    choose_linear_kernels(model, kernel)
    packed = [layer.packed_weight for layer in (model.first, model.second)]
    if kernel == "onednn":
        assert all(p is not None and all(p.used_at) for p in packed)
    if kernel == "torch":
        assert packed == [None, None]
    assert_linears_match_f_linear(model, rows)


@needs_onednn
def test_measured_choice_is_cached_per_machine_and_shape(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOENGINE_CACHE", str(tmp_path))
    chosen = {"40x96 float32": [False, True, True], "8x40 float32": [False, False, False]}
    monkeypatch.setattr(linear_module, "onednn_faster_at", lambda weight, _: chosen[linear_module.shape_key(weight)])
    model = TwoLinears(torch.float32)
    choose_linear_kernels(model)
    assert model.first.packed_weight.used_at == (False, True, True) and model.second.packed_weight is None
    monkeypatch.setattr(linear_module, "onednn_faster_at", lambda weight, _: pytest.fail("timed again"))
    again = TwoLinears(torch.float32)
    choose_linear_kernels(again)
    assert again.first.packed_weight.used_at == (False, True, True)
    for rows in (1, 5, 40):
        assert_linears_match_f_linear(again, rows)


def test_unknown_kernel_is_refused():
    with pytest.raises(ValueError, match="kernel"):
        choose_linear_kernels(TwoLinears(torch.float32), "mkl")


@pytest.mark.skipif(not can_pack_for_onednn(torch.empty(1, dtype=torch.bfloat16)), reason="no oneDNN bf16 here")
def test_onednn_linear_bfloat16():
    torch.manual_seed(0)
    model = TwoLinears(torch.bfloat16)
    choose_linear_kernels(model, "onednn")
    assert_linears_match_f_linear(model, 17, tolerance=2e-2)


def test_weights_that_onednn_cannot_take_stay_unpacked():
    model = TwoLinears(torch.float16)
    choose_linear_kernels(model, "onednn")
    assert model.first.packed_weight is None and model.second.packed_weight is None
