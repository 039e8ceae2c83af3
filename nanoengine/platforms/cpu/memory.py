"""Keep freed activation memory in the process on the CPU, instead of giving it back to the kernel.

glibc serves an allocation over 32 MB (the most its adaptive threshold reaches) with a fresh ``mmap`` and
returns it on free, so the next allocation of that size faults in and zeroes new pages. A prefill step
allocates gigabytes of such temporaries (the MLP's activations alone are 100 MB per layer at 8,192
tokens), and on this project's machine the faults cost about a quarter of the step. Raising glibc's
thresholds keeps those blocks in the heap for reuse, as preloading tcmalloc does for vLLM's CPU backend.
The setting is per process: memory freed after a peak is kept for the next one. Reuse is likely, not
certain: in about one process in six, repeated 256 MB blocks each land above the last, faulting as before
(tests/test_cpu_memory.py).
"""

import ctypes
import platform

# From glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30        # only allocations above 1 GiB still get their own mapping
TRIM_THRESHOLD = (1 << 31) - 1  # keep up to 2 GiB of free memory at the top of the heap


def keep_freed_memory() -> bool:
    """True if the process's allocator now keeps freed memory (only glibc on Linux can be asked)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(None)  # the C library this process already runs on
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
