"""Layers whose CPU fast paths must not change the math."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.layers.activation import SiluAndMul
from nanoengine.layers.norm import RMSNorm
from nanoengine.layers.rotary import RotaryEmbedding
from nanoengine.platforms.cpu import build, ops
from nanoengine.platforms.cpu import linear as linear_module
from nanoengine.platforms.cpu.linear import can_pack_for_onednn, choose_linear_kernels, linear

needs_onednn = pytest.mark.skipif(not can_pack_for_onednn(torch.empty(1)), reason="this torch build has no oneDNN")


class TwoLinears(nn.Module):
    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.first, self.second = nn.Linear(96, 40, dtype=dtype), nn.Linear(40, 8, bias=False, dtype=dtype)
        self.first.kernel_choice = self.second.kernel_choice = None


def assert_linears_match_f_linear(model: TwoLinears, rows: int, tolerance: float = 1e-5) -> None:
    x = torch.randn(rows, 96, dtype=model.first.weight.dtype)
    # The second layer's input is a non-contiguous view.
    for layer, inputs in ((model.first, x), (model.second, x[:, :40])):
        out = linear(inputs, layer.weight, layer.bias, layer.kernel_choice)
        assert out.shape == (rows, layer.out_features) and out.dtype == inputs.dtype
        torch.testing.assert_close(out, F.linear(inputs, layer.weight, layer.bias), rtol=tolerance, atol=tolerance)


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 2, 7, 8, 9, 16, 17, 31, 32, 33, 64, 65, 300])
@pytest.mark.parametrize("kernel", ["onednn", "torch", "auto"])
def test_every_linear_kernel_choice_matches_f_linear(kernel, rows, monkeypatch, tmp_path):
    monkeypatch.setenv("NANOENGINE_CACHE", str(tmp_path))
    torch.manual_seed(rows)
    model = TwoLinears(torch.float32)
    choose_linear_kernels(model, kernel)
    choices = [layer.kernel_choice for layer in (model.first, model.second)]
    if kernel == "onednn":
        assert all(c is not None and set(c.used_at) == {"onednn"} for c in choices)
    if kernel == "torch":
        assert choices == [None, None]
    assert_linears_match_f_linear(model, rows)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 33, 300])
def test_weights_widened_to_float32_give_f_linear_in_float32_narrowed(dtype, rows):
    """The product of two 16-bit floats is exact in float32, so the widened kernel is the float32 product of
    the same values, rounded once; the shared scratch holds each layer's weight only while it multiplies."""
    torch.manual_seed(rows)
    model = TwoLinears(dtype)
    choose_linear_kernels(model, "float32")
    first, second = model.first.kernel_choice, model.second.kernel_choice
    assert first.used_at == ("float32",) * 4 and first.scratch is second.scratch
    assert first.scratch.numel() == 96 * 40 and first.packed is None
    first.scratch.fill_(float("nan"))
    x = torch.randn(rows, 96, dtype=dtype)
    for layer, inputs in ((model.first, x), (model.second, x[:, :40])):
        out = linear(inputs, layer.weight, layer.bias, layer.kernel_choice)
        bias = None if layer.bias is None else layer.bias.float()
        expected = F.linear(inputs.float(), layer.weight.float(), bias).to(dtype)
        assert out.dtype == dtype and torch.equal(out, expected)
        torch.testing.assert_close(out, F.linear(inputs, layer.weight, layer.bias), rtol=2e-2, atol=2e-2)


@needs_onednn
def test_measured_choice_is_cached_per_machine_and_shape(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOENGINE_CACHE", str(tmp_path))
    chosen = {"40x96 float32": ["torch", "onednn", "onednn", "onednn"], "8x40 float32": ["torch"] * 4}
    monkeypatch.setattr(linear_module, "fastest_at",
                        lambda weight, cpu_ops, x_dtype: chosen[linear_module.shape_key(weight, x_dtype)])
    model = TwoLinears(torch.float32)
    choose_linear_kernels(model)
    assert model.first.kernel_choice.used_at == ("torch", "onednn", "onednn", "onednn")
    assert model.second.kernel_choice is None
    monkeypatch.setattr(linear_module, "fastest_at", lambda weight, cpu_ops, x_dtype: pytest.fail("timed again"))
    again = TwoLinears(torch.float32)
    choose_linear_kernels(again)
    assert again.first.kernel_choice.used_at == ("torch", "onednn", "onednn", "onednn")
    for rows in (1, 5, 40):
        assert_linears_match_f_linear(again, rows)


@needs_onednn
def test_an_older_cache_entry_is_timed_again(monkeypatch, tmp_path):
    """An entry written by a version with other buckets or kernels (here: one flag per three buckets) is
    replaced, not misread."""
    monkeypatch.setenv("NANOENGINE_CACHE", str(tmp_path))
    model = TwoLinears(torch.float32)
    machine = linear_module.machine_key()
    old = {"40x96 float32": [False, True, True], "8x40 float32": ["torch", "float32", "torch", "torch"]}
    (tmp_path / "linear-kernels.json").write_text(json.dumps({machine: old}))
    monkeypatch.setattr(linear_module, "fastest_at", lambda weight, cpu_ops, x_dtype: ["onednn"] * 4)
    choose_linear_kernels(model)
    assert model.first.kernel_choice.used_at == model.second.kernel_choice.used_at == ("onednn",) * 4


def test_a_changed_kernel_is_timed_again(monkeypatch, tmp_path):
    """The cached choices are keyed by our kernel's code too: an edited kernel does not inherit the old one's."""
    before = linear_module.machine_key()
    assert linear_module.machine_key() == before
    edited = tmp_path / "cpu_linear.cpp"
    edited.write_bytes(b"".join(path.read_bytes() for path in linear_module.KERNEL_CODE) + b"// edited\n")
    monkeypatch.setattr(linear_module, "KERNEL_CODE", [edited])
    assert linear_module.machine_key() != before


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
    assert model.first.kernel_choice is None and model.second.kernel_choice is None


# The small ops' C++ kernels (platforms/cpu/csrc/cpu_ops.cpp) against the torch modules ---------------------------

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.fixture(scope="module")
def cpu_ops():
    kernels = build.load_cpu_kernels()
    assert kernels is not None, "the C++ kernels did not build: see the warning logged above"
    return kernels


def assert_kernel_matches(out: torch.Tensor, expected: torch.Tensor, max_units: int = 1) -> None:
    """float32: within the sums' reordering. bfloat16 and float16: equal, but for at most ``max_units`` units
    in the last place in at most 0.5% of the elements (where a C++ exp or sum rounds the other way)."""
    assert not out.isnan().any()
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=2e-6, atol=2e-6)
        return
    units_apart = (out.view(torch.int16).int() - expected.view(torch.int16).int()).abs()
    assert units_apart.max() <= max_units and (units_apart > 0).float().mean() <= 0.005, units_apart.max()


# A normalized value one unit off torch's (1/sqrt against rsqrt, sums in another order) is up to two units off
# once multiplied by a weight whose significand is near 2 (one fp16 case in about ten runs of random inputs).
WEIGHTED_UNITS = 2


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("rows, dim", [(1, 576), (7, 576), (300, 64)])
def test_the_rms_norm_kernel_matches_the_module(cpu_ops, dtype, rows, dim):
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.copy_(torch.randn(dim))
    x = torch.randn(rows, dim, dtype=dtype) * 3
    out = torch.full_like(x, float("nan"))
    cpu_ops.rms_norm(x, norm.weight, norm.eps, out)
    assert_kernel_matches(out, norm(x), max_units=WEIGHTED_UNITS)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_the_add_rms_norm_kernel_adds_into_the_residual_and_normalizes_the_sum(cpu_ops, dtype, rows):
    norm = RMSNorm(576, 1e-5).to(dtype)
    norm.weight.copy_(torch.randn(576))
    x, residual = torch.randn(rows, 576, dtype=dtype) * 3, torch.randn(rows, 576, dtype=dtype) * 3
    expected_sum = norm(x, residual)[1]  # the torch path: Hugging Face's add, then the norm
    assert torch.equal(expected_sum, residual + x)
    stream, out = residual.clone(), torch.full_like(x, float("nan"))
    cpu_ops.add_rms_norm(x, stream, norm.weight, norm.eps, out)
    assert torch.equal(stream, expected_sum)  # in place, rounded once, as torch's add
    normed = torch.empty_like(x)
    cpu_ops.rms_norm(expected_sum, norm.weight, norm.eps, normed)  # tested against the module above
    assert torch.equal(out, normed)
    ops.use_small_op_kernels(norm, cpu_ops)  # the module on the CPU: the kernel, the stream in place
    stream = residual.clone()
    module_out, returned = norm(x, stream)
    assert returned is stream and torch.equal(stream, expected_sum) and torch.equal(module_out, out)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
def test_the_rms_norm_kernel_reads_the_heads_of_a_qkv_view(cpu_ops, dtype):
    """Qwen3's q and k norms: the heads of a view into the fused QKV output (not contiguous)."""
    norm = RMSNorm(64, 1e-6).to(dtype)
    norm.weight.copy_(torch.randn(64))
    qkv = torch.randn(5, (9 + 3 + 3) * 64, dtype=dtype)
    k = qkv[:, 9 * 64:12 * 64].view(5, 3, 64)
    out = torch.full(k.shape, float("nan"), dtype=dtype)
    cpu_ops.rms_norm(k, norm.weight, norm.eps, out)
    assert_kernel_matches(out, norm(k), max_units=WEIGHTED_UNITS)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("rows, dim", [(1, 1536), (33, 1536), (3, 1539)])  # 1539: 16-wide lanes and a tail
def test_the_silu_and_mul_kernel_matches_the_module(cpu_ops, dtype, rows, dim):
    gate_up = torch.randn(rows, 2 * dim, dtype=dtype) * 3
    out = torch.full((rows, dim), float("nan"), dtype=dtype)
    cpu_ops.silu_and_mul(gate_up, out)
    # A silu one unit off torch's (another exp, another rounding) can be two units off once multiplied by up.
    assert_kernel_matches(out, SiluAndMul()(gate_up), max_units=2)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_the_rotary_kernel_rotates_q_and_k_in_place_and_nothing_else(cpu_ops, dtype, head_dim):
    heads, kv_heads, tokens = 4, 2, 9
    rotation = RotaryEmbedding(head_dim, 4096, {"rope_theta": 1e6})(torch.randint(0, 4096, (tokens,)), dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q_size, kv_size = heads * head_dim, kv_heads * head_dim
    expected_q, expected_k = (rotation.apply(x.view(tokens, -1, head_dim))
                              for x in qkv.split([q_size, kv_size, kv_size], dim=-1)[:2])
    rotated = qkv.clone()
    q, k, v = rotated.split([q_size, kv_size, kv_size], dim=-1)
    in_place = ops.KernelRotation(*rotation, cpu_ops)
    for x, expected in ((q.view(tokens, heads, head_dim), expected_q), (k.view(tokens, kv_heads, head_dim),
                                                                         expected_k)):
        assert in_place.apply(x).data_ptr() == x.data_ptr()
        assert_kernel_matches(x, expected)
    assert torch.equal(v, qkv[:, q_size + kv_size:])


def test_the_small_op_kernels_refuse_what_they_cannot_read(cpu_ops):
    with pytest.raises(RuntimeError, match="one dtype"):
        cpu_ops.rms_norm(torch.randn(2, 8), torch.ones(8, dtype=torch.bfloat16), 1e-6, torch.empty(2, 8))
    with pytest.raises(RuntimeError, match="contiguous CPU x and residual"):
        cpu_ops.add_rms_norm(torch.randn(2, 8), torch.randn(2, 9), torch.ones(8), 1e-6, torch.empty(2, 8))
    with pytest.raises(RuntimeError, match="float32, bfloat16 or float16"):
        cpu_ops.silu_and_mul(torch.ones(2, 8, dtype=torch.float64), torch.empty(2, 4, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="even head_dim"):
        cpu_ops.rotary(torch.randn(2, 1, 7), torch.randn(2, 7), torch.randn(2, 7))


@pytest.mark.parametrize("columns", [49152, 37, 16, 1])  # the 16-wide loop, its tail, both, the tail alone
def test_the_argmax_kernel_is_torchs_with_ties_infinities_and_nan(cpu_ops, columns):
    logits = torch.randn(8, columns)
    logits[1] = float("-inf")                                         # all -inf: index 0
    logits[2, columns // 3], logits[2, columns - 1] = 1e9, 1e9        # a tie: the first
    logits[3, columns - 1] = float("inf")
    logits[4, columns // 2], logits[4, columns - 1] = float("nan"), float("nan")  # the first NaN wins
    logits[5, columns - 1] = float("nan")
    logits[5, 0] = float("inf")
    tokens = torch.full((8,), -1, dtype=torch.int64)
    cpu_ops.argmax(logits, tokens)
    assert torch.equal(tokens, logits.argmax(dim=-1))
    assert torch.equal(ops.argmax(logits, cpu_ops), logits.argmax(dim=-1))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        cpu_ops.argmax(logits.t(), tokens)


# The few-row linear kernel (layers/cpu_linear.cpp) against the exact product -------------------------------------

LINEAR_DTYPES = [torch.float32, torch.bfloat16]


def test_the_linear_kernel_multiplies_every_weight_type_at_every_level(cpu_ops):
    assert {"float32", "bfloat16", "int8"} <= set(cpu_ops.linear_dtypes())


def assert_rounded_exact_product(out: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, bias) -> None:
    """Each output is the exact sum rounded once to its dtype, give or take what float32 accumulation can move
    it: within half a unit in the last place plus K float32 roundings of the largest partial sum."""
    terms = x.double().unsqueeze(1) * weight.double().unsqueeze(0)  # [rows, N, K]
    exact = terms.sum(-1) + (0 if bias is None else bias.double())
    accumulation = terms.abs().sum(-1) * weight.shape[1] * 2.0**-24
    mantissa_bits = 7 if out.dtype == torch.bfloat16 else 23
    unit = torch.exp2(torch.floor(torch.log2(exact.abs().clamp_min(2.0**-100))) - mantissa_bits)
    assert not out.isnan().any()
    assert ((out.double() - exact).abs() <= unit / 2 + accumulation).all()


@pytest.mark.parametrize("dtype", LINEAR_DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 7, 8, 9, 16, 17, 23, 33])
@pytest.mark.parametrize("out_features, in_features", [(16, 2), (48, 34), (112, 96), (400, 576)])
def test_the_linear_kernel_gives_the_exact_product_rounded_once(cpu_ops, dtype, rows, out_features, in_features):
    """Every row count the tiles split differently (1-2, 3-4 and 8-row chunks, and each remainder), outputs
    that leave partial tiles of blocks (7, 25 blocks), and NaN in out before the call."""
    torch.manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, dtype=dtype)
    x = torch.randn(rows, in_features, dtype=dtype)
    for bias in (None, torch.randn(out_features, dtype=dtype)):
        out = torch.full((rows, out_features), float("nan"), dtype=dtype)
        cpu_ops.linear(x, linear_module.pack_steps(weight), None, None, bias, out)
        assert_rounded_exact_product(out, x, weight, bias)


@pytest.mark.parametrize("dtype", LINEAR_DTYPES, ids=["fp32", "bf16"])
def test_the_linear_kernel_cuts_an_x_larger_than_l2_into_panels_that_change_no_bit(cpu_ops, dtype):
    """1601 rows of 576 inputs (1.8 MB in bfloat16, above the kernel's 1 MiB) go through in panels, the last
    one short; each row's outputs are those of the same rows multiplied 33 at a time, where there are none."""
    torch.manual_seed(1)
    weight, bias = torch.randn(112, 576, dtype=dtype), torch.randn(112, dtype=dtype)
    x, packed = torch.randn(1601, 576, dtype=dtype), linear_module.pack_steps(weight)
    out = torch.full((1601, 112), float("nan"), dtype=dtype)
    cpu_ops.linear(x, packed, None, None, bias, out)
    for first in range(0, 1601, 33):
        rows = torch.full((min(33, 1601 - first), 112), float("nan"), dtype=dtype)
        cpu_ops.linear(x[first:first + 33], packed, None, None, bias, rows)
        assert torch.equal(out[first:first + 33], rows)
    assert_rounded_exact_product(out[::50], x[::50], weight, bias)


@pytest.mark.parametrize("dtype", LINEAR_DTYPES, ids=["fp32", "bf16"])
def test_the_linear_kernel_through_linear_takes_views_and_batches(cpu_ops, dtype):
    torch.manual_seed(0)
    weight, bias = torch.randn(64, 40, dtype=dtype), torch.randn(64, dtype=dtype)
    choice = linear_module.only_kernel(weight, "tiled", cpu_ops)
    wide = torch.randn(2, 3, 96, dtype=dtype)
    out = linear(wide[..., :40], weight, bias, choice)
    assert out.shape == (2, 3, 64) and out.dtype == dtype
    assert_rounded_exact_product(out.view(6, 64), wide[..., :40].reshape(6, 40), weight, bias)


def test_the_linear_kernel_is_offered_only_for_weights_it_can_pack(cpu_ops):
    offered = [linear_module.kernels_for(torch.empty(shape, dtype=dtype), cpu_ops)
               for shape, dtype in (((64, 40), torch.bfloat16), ((40, 64), torch.bfloat16), ((64, 41), torch.bfloat16),
                                    ((64, 41), torch.float32), ((40, 64), torch.float32), ((64, 40), torch.float16))]
    assert ["tiled" in kernels for kernels in offered] == [True, False, False, True, False, False]
    assert "tiled" not in linear_module.kernels_for(torch.empty(64, 40))  # without the extension


def test_the_linear_kernel_refuses_what_it_cannot_read(cpu_ops):
    weight = torch.randn(32, 8)
    packed, out = linear_module.pack_steps(weight), torch.empty(3, 32)
    for x, into in ((torch.randn(3, 8, dtype=torch.bfloat16), out), (torch.randn(3, 6), out),
                    (torch.randn(3, 16)[:, ::2], out), (torch.randn(3, 8), torch.empty(3, 16)),
                    (torch.randn(3, 8, dtype=torch.float16), out.half())):
        with pytest.raises(RuntimeError, match="linear"):
            cpu_ops.linear(x, packed, None, None, None, into)
