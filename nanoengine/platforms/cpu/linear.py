"""The CPU's linear kernels: for each weight shape and row-count bucket, the fastest of four, chosen by
measurement once per machine (cached in a JSON file), and swapped into the model's linear layers' forward."""

import hashlib
import json
import logging
import os
import time
from bisect import bisect_left
from dataclasses import dataclass
from pathlib import Path
from types import MethodType, ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from nanoengine.distributed import all_reduce, gather_on_rank0
from nanoengine.layers.embedding import ParallelLMHead
from nanoengine.layers.linear import LinearBase, RowParallelLinear
from nanoengine.platforms.cpu.build import build_dir
from nanoengine.platforms.cpu.quantize import dequantize_int4, in_features_of, unpack_int4
from nanoengine.utils.cpu_info import cpu_model

logger = logging.getLogger(__name__)

# Four kernels can multiply by a weight, and which is fastest depends on the CPU, the dtype, the shape and the rows
# (docs/cpu.md): torch's F.linear (MKL), oneDNN's packed weight (its own layout, made once; torch exposes the pair
# of ops only privately, so both calls are kept to this file), the weight widened to float32 into a scratch buffer
# (exact: a product of two 16-bit floats is exact in float32), and our tiled kernel (cpu_linear.cpp, on the vector
# layer), which reads the weight at the memory's speed at a decode's few rows. So the kernel is chosen by
# measurement, per weight shape and row bucket. An int8 or 4-bit weight (quantize.py) takes our kernel, or is
# dequantized into the float32 scratch buffer ("float32"), or, as the oracle, into a new one ("torch").
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)
WIDENED_DTYPES = (torch.bfloat16, torch.float16, torch.int8, torch.uint8)
ONEDNN_ROWS_HINT = 32  # the layout barely depends on the batch size it is made for
ROW_BUCKETS = (1, 8, 32, 256)  # a call with <= 1, <= 8, <= 32 or more rows takes the kernel timed at these rows
# F.linear, oneDNN's packed weight, widened to float32, cpu_linear.cpp's kernel
KERNELS = ("torch", "onednn", "float32", "tiled")
CHOICES = ("auto", *KERNELS)
# our kernel's code
KERNEL_CODE = [Path(__file__).parent / "csrc" / name for name in ("cpu_linear.cpp", "cpu_simd.h", "cpu_vec.h")]


@dataclass
class KernelChoice:
    """Per row bucket, the kernel ``linear`` multiplies by one weight with, and what those kernels need."""

    used_at: tuple[str, ...]
    packed: torch.Tensor | None = None  # the weight in oneDNN's layout, where a bucket uses "onednn"
    scratch: torch.Tensor | None = None  # float32, at least the weight's size (shared by the model's layers)
    steps: torch.Tensor | None = None  # the weight in cpu_linear.cpp's layout, where a bucket uses "tiled"
    cpu_ops: ModuleType | None = None  # the extension that holds cpu_linear.cpp
    scale: torch.Tensor | None = None  # an int8 weight's float32 scale per output, a 4-bit one's per group
    minimum: torch.Tensor | None = None  # a 4-bit weight's minimum per group (quantize.py); None for a symmetric one
    steps_scale: torch.Tensor | None = None  # ``scale`` as "tiled" reads it (tiled_scales)
    steps_min: torch.Tensor | None = None  # ``minimum`` as "tiled" reads it


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           choice: KernelChoice | None = None) -> torch.Tensor:
    if choice is None:
        return F.linear(x, weight, bias)
    rows = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    kernel = kernel_at(choice, bucket_of(rows.shape[0]))
    if kernel == "onednn":
        return torch.ops.mkldnn._linear_pointwise(x, choice.packed, bias, "none", [None], "")
    if kernel == "tiled":
        out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype)
        choice.cpu_ops.linear(rows.contiguous(), choice.steps, choice.steps_scale, choice.steps_min, bias, out)
        return out.view(*x.shape[:-1], weight.shape[0])
    if kernel == "float32" or choice.scale is not None:  # a quantized weight's "torch" too: the oracle's math
        shape = (weight.shape[0], in_features_of(weight))
        wide = choice.scratch[:shape[0] * shape[1]].view(shape) if kernel == "float32" else None
        wide = widened(weight, choice, wide)
        return F.linear(x.float(), wide, None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


def widened(weight: torch.Tensor, choice: KernelChoice, into: torch.Tensor | None = None) -> torch.Tensor:
    """``weight`` in float32, in ``into`` or a new tensor; a quantized one dequantized with ``choice``'s scales."""
    if weight.dtype == torch.uint8:
        return dequantize_int4(weight, choice.scale, choice.minimum, into)
    wide = (torch.empty(weight.shape) if into is None else into).copy_(weight)
    return wide if choice.scale is None else wide.mul_(choice.scale.unsqueeze(1))


def bucket_of(num_rows: int) -> int:
    """The index of the row bucket whose kernel multiplies ``num_rows`` rows."""
    return bisect_left(ROW_BUCKETS, num_rows, hi=len(ROW_BUCKETS) - 1)


def kernel_at(choice: KernelChoice | None, bucket: int) -> str:
    return "torch" if choice is None else choice.used_at[bucket]


def can_pack_for_onednn(weight: torch.Tensor) -> bool:
    if weight.device.type != "cpu" or weight.dtype not in ONEDNN_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_for_onednn(weight: torch.Tensor) -> torch.Tensor:
    """A copy of ``weight`` in oneDNN's layout, for ``linear`` at every row count."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), ONEDNN_ROWS_HINT)


def pack_steps(weight: torch.Tensor) -> torch.Tensor:
    """A copy of ``weight`` [N, K] as [N/16, K/step, 16, step], cpu_linear.cpp's loads in the order it reads
    them: a step is two inputs in bfloat16 (what one dpbf16 multiplies), one in float32 or int8. A 4-bit weight
    [N, K/2] becomes [N/16, K/8, 16, 4]: a step is eight inputs in one little-endian 32-bit word per output, input
    2p's 4 bits (p = 0..3) at bits 4p, input 2p + 1's at bits 16 + 4p."""
    if weight.dtype == torch.uint8:
        q = unpack_int4(weight.detach()).view(weight.shape[0], -1, 4, 2)  # [N, K/8, p, 2p or 2p + 1]
        weight = (q[..., 0::2, :] | (q[..., 1::2, :] << 4)).transpose(-1, -2).reshape(weight.shape[0], -1)
    step = inputs_per_step(weight.dtype)
    out_features, in_features = weight.shape
    return weight.detach().view(out_features // 16, 16, in_features // step, step).transpose(1, 2).contiguous()


def tiled_scales(weight: torch.Tensor, scale: torch.Tensor | None,
                 minimum: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What cpu_linear.cpp takes beside ``pack_steps(weight)``: an int8 weight's scale as it is; a 4-bit weight's
    scale and minimum (if any) [N, K/32] as [N/16, K/32, 16], a block's 16 outputs side by side for each group."""
    if weight.dtype != torch.uint8:
        return scale, None
    return tuple(None if t is None else t.view(t.shape[0] // 16, 16, -1).transpose(1, 2).contiguous()
                 for t in (scale, minimum))


def inputs_per_step(dtype: torch.dtype) -> int:
    """Elements a step of one output (its 4 bytes for a 4-bit weight)."""
    return 2 if dtype == torch.bfloat16 else 4 if dtype == torch.uint8 else 1


def can_pack_steps(weight: torch.Tensor, cpu_ops: ModuleType | None) -> bool:
    name = "int4" if weight.dtype == torch.uint8 else str(weight.dtype).removeprefix("torch.")  # linear_dtypes()'s
    return (cpu_ops is not None and name in cpu_ops.linear_dtypes()
            and weight.shape[0] % 16 == 0 and weight.shape[1] % inputs_per_step(weight.dtype) == 0)


def kernels_for(weight: torch.Tensor, cpu_ops: ModuleType | None = None) -> tuple[str, ...]:
    """The kernels that can multiply by this weight (on the CPU; ``cpu_ops``: the C++ extension, if built)."""
    if weight.device.type != "cpu":
        return ("torch",)
    return (("torch",) + ("onednn",) * can_pack_for_onednn(weight) + ("float32",) * (weight.dtype in WIDENED_DTYPES)
            + ("tiled",) * can_pack_steps(weight, cpu_ops))


def choose_linear_kernels(model: nn.Module, kernel: str = "auto", cpu_ops: ModuleType | None = None) -> None:
    """Give every linear layer (and the LM head) the fastest kernel for its shape at each row bucket: measured
    once per machine and cached (``kernel="auto"``), or forced (where the weight allows it, else F.linear).
    ``cpu_ops``: the C++ extension (build.py), for cpu_linear.cpp's kernel."""
    if kernel not in CHOICES:
        raise ValueError(f"kernel must be one of {CHOICES}, got {kernel!r}")
    layers = [m for m in model.modules() if hasattr(m, "kernel_choice") and len(kernels_for(m.weight, cpu_ops)) > 1]
    x_dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())  # int8 weights' x: the model's
    if kernel != "auto":
        choices = {shape_key(m.weight, x_dtype): (kernel if kernel in kernels_for(m.weight, cpu_ops) else "torch",)
                   * len(ROW_BUCKETS) for m in layers}
    else:
        choices = measured_choices({shape_key(m.weight, x_dtype): m.weight for m in layers}, cpu_ops, x_dtype)
    widened_sizes = [m.weight.shape[0] * in_features_of(m.weight) for m in layers
                     if "float32" in choices[shape_key(m.weight, x_dtype)]]
    scratch = torch.empty(max(widened_sizes), dtype=torch.float32) if widened_sizes else None
    for module in layers:
        used_at, scale = choices[shape_key(module.weight, x_dtype)], getattr(module, "weight_scale", None)
        module.kernel_choice = None if set(used_at) == {"torch"} and scale is None else kernel_choice(
            module.weight, used_at, cpu_ops, scratch, scale, getattr(module, "weight_min", None))


def kernel_choice(weight: torch.Tensor, used_at: tuple[str, ...], cpu_ops: ModuleType | None,
                  scratch: torch.Tensor | None, scale: torch.Tensor | None = None,
                  minimum: torch.Tensor | None = None) -> KernelChoice:
    """The kernels ``used_at`` each row bucket for this weight (a quantized one with its ``scale``, and
    ``minimum``), with the packed copies they read."""
    tiled = "tiled" in used_at
    return KernelChoice(used_at, pack_for_onednn(weight) if "onednn" in used_at else None, scratch,
                        pack_steps(weight) if tiled else None, cpu_ops, scale, minimum,
                        *(tiled_scales(weight, scale, minimum) if tiled else (None, None)))


def shape_key(weight: torch.Tensor, x_dtype: torch.dtype) -> str:
    """A weight's shape (out x in) and type, and for a quantized one, x's type."""
    if weight.is_floating_point():
        return f"{weight.shape[0]}x{weight.shape[1]} {str(weight.dtype).removeprefix('torch.')}"
    kind = "int4" if weight.dtype == torch.uint8 else "int8"
    return f"{weight.shape[0]}x{in_features_of(weight)} {kind} x {str(x_dtype).removeprefix('torch.')}"


def measured_choices(weights: dict[str, torch.Tensor], cpu_ops: ModuleType | None,
                     x_dtype: torch.dtype) -> dict[str, tuple[str, ...]]:
    """Per shape, the fastest kernel at each row bucket; shapes this machine has not timed yet are timed now
    (the log says how long it took) and added to the cache file. Delete the file to time again (figures
    taken while other work loads the machine can pick the wrong kernel)."""
    path = build_dir() / "linear-kernels.json"
    cache = json.loads(path.read_text()) if path.is_file() else {}
    known = cache.setdefault(machine_key(), {})
    start = time.perf_counter()
    # An entry of another shape (an older version's, with other buckets or kernels) is timed again.
    missing = {key: weight for key, weight in weights.items()
               if not (isinstance(known.get(key), list) and len(known[key]) == len(ROW_BUCKETS)
                       and set(known[key]) <= set(kernels_for(weight, cpu_ops)))}
    known.update({key: fastest_at(weight, cpu_ops, x_dtype) for key, weight in missing.items()})
    if missing:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.with_suffix(f".tmp-{os.getpid()}")
        temp.write_text(json.dumps(cache, indent=1))
        temp.replace(path)
    names = ", ".join(f"{key}: " + "/".join(known[key]) for key in weights)
    how = f"measured in {time.perf_counter() - start:.2f} s" if missing else f"from {path}"
    logger.info("linear kernels at rows %s (%s): %s", "/".join(f"<={r}" for r in ROW_BUCKETS[:-1]) + "/more",
                how, names)
    return {key: tuple(known[key]) for key in weights}


def machine_key() -> str:
    """What the cached choices hold for: the CPU, torch, its threads, the kernels there were to choose from and
    our kernel's code (a changed kernel is timed again)."""
    code = hashlib.sha1(b"".join(path.read_bytes() for path in KERNEL_CODE)).hexdigest()[:12]
    return (f"{cpu_model()}; torch {torch.__version__}; {torch.get_num_threads()} threads; {'/'.join(KERNELS)}; "
            f"cpu_linear.cpp {code}")


def fastest_at(weight: torch.Tensor, cpu_ops: ModuleType | None = None, x_dtype: torch.dtype | None = None,
               rounds: int = 5) -> list[str]:
    """The fastest kernel for this weight (times x of ``x_dtype``, by default the weight's) at each bucket's row
    count: each kernel's best of ``rounds`` calls, the kernels taking turns, so that a burst of other work on the
    machine weighs on all of them alike."""
    scale = minimum = None
    if weight.dtype == torch.int8:
        scale = torch.ones(weight.shape[0])
    elif weight.dtype == torch.uint8:  # groups of 32 (the choice depends little on the group size)
        scale = minimum = torch.ones(weight.shape[0], in_features_of(weight) // 32, dtype=torch.float16)
    candidates = {kernel: only_kernel(weight, kernel, cpu_ops, scale, minimum)
                  for kernel in kernels_for(weight, cpu_ops)}
    fastest = []
    for rows in ROW_BUCKETS:
        x = torch.randn(rows, in_features_of(weight), dtype=x_dtype or weight.dtype)
        best = dict.fromkeys(candidates, float("inf"))
        for round_number in range(rounds + 1):
            for kernel, choice in candidates.items():
                start = time.perf_counter()
                linear(x, weight, choice=choice)
                if round_number > 0:  # the first round warms up
                    best[kernel] = min(best[kernel], time.perf_counter() - start)
        fastest.append(min(best, key=best.get))
    return fastest


def only_kernel(weight: torch.Tensor, kernel: str, cpu_ops: ModuleType | None = None,
                scale: torch.Tensor | None = None, minimum: torch.Tensor | None = None) -> KernelChoice:
    """``kernel`` for this weight (a quantized one with its ``scale``, and ``minimum``) at every row count, with what
    it needs."""
    wide = weight.shape[0] * in_features_of(weight)
    return kernel_choice(weight, (kernel,) * len(ROW_BUCKETS), cpu_ops,
                         torch.empty(wide, dtype=torch.float32) if kernel == "float32" else None, scale, minimum)


def use_linear_kernels(model: nn.Module, cpu_ops: ModuleType | None) -> None:
    """Swap the forward of the model's linear layers and LM head for one that multiplies by the kernel
    ``choose_linear_kernels`` chose for the call's row count (F.linear, where it chose none), and choose."""
    for module in model.modules():
        if isinstance(module, (LinearBase, ParallelLMHead)):
            module.kernel_choice = None
            forward = (row_parallel_forward if isinstance(module, RowParallelLinear) else
                       lm_head_forward if isinstance(module, ParallelLMHead) else linear_forward)
            module.forward = MethodType(forward, module)
    choose_linear_kernels(model, cpu_ops=cpu_ops)


def linear_forward(self: LinearBase, x: torch.Tensor) -> torch.Tensor:
    return linear(x, self.weight, self.bias, self.kernel_choice)


def row_parallel_forward(self: RowParallelLinear, x: torch.Tensor) -> torch.Tensor:
    return all_reduce(linear(x, self.weight, self.bias if self.adds_bias else None, self.kernel_choice))


def lm_head_forward(self: ParallelLMHead, hidden: torch.Tensor) -> torch.Tensor | None:
    return gather_on_rank0(linear(hidden, self.weight, choice=self.kernel_choice), dim=-1)
