"""Attention backends: each offers ``store_kv`` and ``paged_attention`` with one contract.

``torch`` states the math plainly and runs anywhere: it is the oracle the others are tested against.
``triton`` runs it as GPU kernels (or on the CPU under ``TRITON_INTERPRET=1``). The ``cpu`` backend, the same
contract with C++ kernels, belongs to the CPU platform (platforms/cpu/attention.py).
"""

import importlib
from types import ModuleType


def load_backend(name: str) -> ModuleType:
    """The module of the ``torch`` or ``triton`` backend."""
    if name not in ("torch", "triton"):
        raise ValueError(f"no attention backend {name!r} here (the cpu backend is the CPU platform's)")
    return importlib.import_module(f"nanoengine.attention.{name}_backend")
