"""The CPU platform: everything that exists only for CPU speed, swapped into the plain torch model.

- memory.py     keep freed activation memory in the process (glibc's thresholds), set once per process
- build.py      the one C++ extension (csrc/), built for this machine on first use
- attention.py  the ``cpu`` attention backend: the C++ decode and prefill kernels
- linear.py     per weight shape and row count, the fastest matmul kernel, measured once and cached
- quantize.py   int8 and 4-bit weights (quantization="int8" or "int4"), quantized at load
- gguf.py       a GGUF file's weights, loaded in the formats above as the file holds them
- ops.py        RMSNorm, SiLU-and-mul, rotary and argmax as C++ kernels, in place of the layers' torch forwards
- one_call.py   the decoder layers in one C++ call: the CPU's counterpart of CUDA graphs

Every kernel computes what the plain layer computes, in the same order (tests/test_layers.py,
tests/test_cpu_attention.py, tests/test_models.py).
"""

from functools import partial

import torch
from torch import nn

from nanoengine.distributed import tp_size
from nanoengine.platforms import Platform
from nanoengine.platforms.cpu import ops
from nanoengine.platforms.cpu.attention import CpuBackend, load_backend
from nanoengine.platforms.cpu.build import load_cpu_kernels
from nanoengine.platforms.cpu.gguf import load_gguf
from nanoengine.platforms.cpu.linear import use_linear_kernels
from nanoengine.platforms.cpu.memory import keep_freed_memory
from nanoengine.platforms.cpu.one_call import LayersInOneCall
from nanoengine.platforms.cpu.quantize import quantize_linear_layers
from nanoengine.utils.gguf_file import is_gguf


class CpuPlatform(Platform):
    def __init__(self, attention_backend: str, quantization: str | None = None):
        keep_freed_memory()
        # The C++ extension comes with the cpu attention backend (the torch and triton backends run without it).
        self.kernels = load_cpu_kernels() if attention_backend == "cpu" else None
        self.quantization = quantization
        if quantization is not None and (self.kernels is None or quantization not in self.kernels.linear_dtypes()):
            raise ValueError(f"quantization={quantization!r}: this machine's CPU kernels cannot multiply "
                             f"{quantization} weights (they need a C++ compiler: see the warning above); "
                             "leave quantization unset")

    def attention_backend(self, name: str):
        return CpuBackend(self.kernels) if name == "cpu" else load_backend(name)

    def load_weights(self, model: nn.Module, config) -> None:
        if is_gguf(config.model):
            load_gguf(model, config.gguf(), config.hf_config)
        else:
            super().load_weights(model, config)

    def prepare_model(self, model: nn.Module) -> None:
        if self.quantization is not None:
            quantize_linear_layers(model, self.quantization)
        use_linear_kernels(model, self.kernels)
        if self.kernels is not None:
            ops.use_small_op_kernels(model, self.kernels)

    def warm_up(self, runner) -> None:
        """A full-budget step through one decoder layer, then the logits: its memory faults into the kept heap
        now, not in the first large step (the other layers reuse its temporaries). It writes no cache."""
        if self.kernels is not None:
            runner.run_dummy_step(runner.config.max_num_batched_tokens, partial(first_layer_only, runner.model))

    def fast_path(self, model: nn.Module) -> LayersInOneCall | None:
        if self.kernels is None or tp_size() > 1:
            return None
        return LayersInOneCall.for_model(model, self.kernels)

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return ops.argmax(logits, self.kernels)


def first_layer_only(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
    """The model's forward through its first decoder layer only."""
    decoder = model.model
    hidden = decoder.embed_tokens(input_ids)
    hidden, residual = decoder.layers[0](decoder.rotary_emb(positions, hidden.dtype), hidden, None, meta)
    return decoder.norm(hidden, residual)[0]


__all__ = ["CpuBackend", "CpuPlatform", "load_backend", "load_cpu_kernels"]
