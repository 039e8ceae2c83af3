"""Attention backends: each offers ``store_kv`` and ``paged_attention`` with one contract.

``torch`` states the math plainly and runs anywhere: it is the oracle the others are
tested against. ``cpu`` is the same contract tuned for the CPU (a C++ decode kernel, SDPA's
flash kernel for prompts); ``triton`` runs it as GPU kernels (or on the CPU under ``TRITON_INTERPRET=1``).
"""

import importlib
import os
from types import ModuleType

BACKENDS = ("auto", "torch", "cpu", "triton")


def resolve_backend(name: str, device: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.startswith("cuda") else "cpu"
    if name == "cpu" and device.startswith("cuda"):
        raise ValueError('attention_backend="cpu" runs on the CPU only; use "triton" or "torch" on CUDA')
    if name == "triton" and not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError('attention_backend="triton" on the CPU needs TRITON_INTERPRET=1 in the environment')
    return name


def load_backend(name: str):
    """The backend's module; the CPU backend plans per step, so each call gives a fresh object."""
    module: ModuleType = importlib.import_module(f"nanoengine.attention.{name}_backend")
    return module.CpuBackend(module.load_cpu_kernels()) if name == "cpu" else module
