"""Build the CPU platform's C++ extension (csrc/, one extension) for this machine, once, and load it.

torch's extension builder drives ninja: the first start on a machine compiles it, later starts load
the cached build. Without a C++ compiler every kernel has a torch fallback: correct, several times slower.
"""

import hashlib
import logging
import os
import shutil
import sys
from pathlib import Path
from types import ModuleType

import torch

from nanoengine.utils.cpu_info import cpu_flags, cpu_model
from nanoengine.utils.default_model import cache_dir

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
KERNEL_SOURCES = [SOURCE_DIR / name for name in ("cpu_decode.cpp", "cpu_prefill.cpp", "cpu_ops.cpp",
                                                 "cpu_linear.cpp", "cpu_decoder.cpp")]
# -march=native: the build is for this CPU only (its folder is named after it). -ffast-math lets the
# compiler vectorize the dot products and exp (glibc's vector exp needs all of it, finite math included).
# -fopenmp: torch's parallel_for splits the (request, KV head) tasks over its threads.
KERNEL_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


def load_cpu_kernels() -> ModuleType | None:
    """The extension built for this machine (attention, the small ops, the linear kernel, the layers in one
    call), or None (logged) where it cannot be."""
    from torch.utils.cpp_extension import load

    # The sources' paths are in the key: ninja rebuilds whenever they change, so two checkouts sharing one
    # folder would rebuild each other's build at every start.
    machine = f"{cpu_model()} {sorted(cpu_flags())} torch {torch.__version__} python {sys.version_info[:2]}"
    build = cache_dir() / "cpu-kernels" / hashlib.sha1(f"{machine} {KERNEL_SOURCES}".encode()).hexdigest()[:12]
    try:
        if shutil.which("ninja") is None:  # pip's ninja lives beside this interpreter, which may not be on PATH
            import ninja
            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        build.mkdir(parents=True, exist_ok=True)
        # A build killed midway leaves a "lock" file in the folder that stalls the next one: delete it then.
        logger.info("loading the CPU kernels from %s (the first time builds them)", build)
        return load("nanoengine_cpu_kernels", [str(s) for s in KERNEL_SOURCES], extra_cflags=KERNEL_FLAGS,
                    extra_ldflags=["-fopenmp"], build_directory=str(build))
    except (OSError, RuntimeError, ImportError) as error:
        logger.warning("the CPU kernels could not be built (%s); every op takes its slower torch path", error)
        return None
