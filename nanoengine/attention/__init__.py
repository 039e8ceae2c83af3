"""Attention backends: each offers ``store_kv`` and ``paged_attention`` with one contract.

``torch`` states the math plainly and runs anywhere; ``triton`` runs the same
contract as GPU kernels (or on the CPU under ``TRITON_INTERPRET=1``).
"""

import importlib
import os
from types import ModuleType

BACKENDS = ("auto", "torch", "triton")


def resolve_backend(name: str, device: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {BACKENDS}, got {name!r}")
    if name == "auto":
        return "triton" if device.startswith("cuda") else "torch"
    if name == "triton" and not device.startswith("cuda") and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError('attention_backend="triton" on the CPU needs TRITON_INTERPRET=1 in the environment')
    return name


def load_backend(name: str) -> ModuleType:
    return importlib.import_module(f"nanoengine.attention.{name}_backend")
