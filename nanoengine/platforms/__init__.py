"""What a device adds to the plain torch model, swapped in when the model runner prepares it.

The runner asks ``platform_for`` once and calls the same few hooks on any device; the plain ``Platform`` (a GPU,
or any device without its own) adds nothing: the layers' torch forwards, a backend from attention/, torch's
argmax. The CPU's platform (platforms/cpu/) brings its C++ kernels: nothing under layers/, models/, attention/
or engine/ imports it.
"""

import torch
from torch import nn

from nanoengine.attention import load_backend
from nanoengine.utils.loader import load_model


class Platform:
    def attention_backend(self, name: str):
        return load_backend(name)

    def load_weights(self, model: nn.Module, config) -> None:
        """Fill the model's parameters from ``config.model`` (EngineConfig's): a folder's safetensors."""
        load_model(model, config.model)

    def prepare_model(self, model: nn.Module) -> None:
        """Swap the platform's kernels into the loaded model (before the KV cache is allocated)."""

    def warm_up(self, runner) -> None:
        """Anything to run once the KV cache is allocated, before the first request."""

    def fast_path(self, model: nn.Module):
        """An object with ``can_run(meta)`` and ``run(input_ids, positions, meta)`` for the steps it runs faster
        than the model's forward, or None (CUDA's graphs are the runner's own: engine/cuda_graphs.py)."""
        return None

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        return logits.argmax(dim=-1)


def platform_for(device: torch.device, attention_backend: str, quantization: str | None = None) -> Platform:
    """``quantization``: EngineConfig's, which it allows on the CPU only."""
    if device.type != "cpu":
        return Platform()
    from nanoengine.platforms.cpu import CpuPlatform

    return CpuPlatform(attention_backend, quantization)
