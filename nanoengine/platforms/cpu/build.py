"""Build the CPU platform's C++ extension (csrc/, one extension) once per CPU and instruction-set level, and load it.

torch's extension builder drives ninja: the first start compiles it, later starts load the cached build.
``NANOENGINE_CPU_ARCH`` (default ``native``) is the ``-march`` it is built for; each value has its own folder
under ``$NANOENGINE_CACHE/cpu-kernels/``, which also holds the linear kernels' measured choice. A failed build
is remembered there and not tried again until the sources, the flags, the compiler or torch change. Without a
build every kernel has a torch fallback: correct, several times slower.
"""

import hashlib
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import torch

from nanoengine.utils.cpu_info import cpu_flags, cpu_model
from nanoengine.utils.default_model import cache_dir

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).with_name("csrc")
KERNEL_SOURCES = [SOURCE_DIR / name for name in ("cpu_module.cpp", "cpu_decode.cpp", "cpu_prefill.cpp",
                                                 "cpu_ops.cpp", "cpu_linear.cpp", "cpu_decoder.cpp")]
ARCH_VARIABLE = "NANOENGINE_CPU_ARCH"
# The instruction sets cpu-info reports, as the compiler's macros name them (__AVX512BF16__ -> avx512bf16).
REPORTED_ISA = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512bf16",
                "avx512vnni", "avxvnni", "amx_bf16")


def cpu_arch() -> str:
    return os.environ.get(ARCH_VARIABLE) or "native"


def kernel_flags(arch: str) -> list[str]:
    # -ffast-math lets the compiler vectorize the dot products and exp (glibc's vector exp needs all of it, finite
    # math included). -fopenmp: torch's parallel_for splits the (request, KV head) tasks over its threads.
    return ["-O3", f"-march={arch}", "-ffast-math", "-fopenmp"]


def compiler() -> str:
    return os.environ.get("CXX") or "c++"  # what torch's extension builder runs


def build_dir(arch: str | None = None) -> Path:
    """The folder of this machine's build for ``arch`` (by default NANOENGINE_CPU_ARCH's). The sources' paths are
    in its name: ninja rebuilds whenever they change, so two checkouts sharing one folder would rebuild each
    other's build at every start."""
    arch = arch or cpu_arch()
    machine = (f"{cpu_model()} {sorted(cpu_flags())} {arch} torch {torch.__version__} python {sys.version_info[:2]}"
               f" {KERNEL_SOURCES}")
    return cache_dir() / "cpu-kernels" / f"{arch}-{hashlib.sha1(machine.encode()).hexdigest()[:12]}"


def build_fingerprint(arch: str) -> str:
    """What a failed build depends on: the sources, the flags, the compiler and torch (its version, and the install
    itself: a torch installed again, as a new environment does, tries again)."""
    sources = b"".join(path.read_bytes() for path in sorted(SOURCE_DIR.iterdir()))
    installed = Path(torch.__file__).stat().st_mtime_ns
    return hashlib.sha1(sources + f"{kernel_flags(arch)} {compiler()} {torch.__version__} {torch.__file__} "
                                  f"{installed}".encode()).hexdigest()


def load_cpu_kernels() -> ModuleType | None:
    """The extension built for this machine (attention, the small ops, the linear kernel, the layers in one
    call), or None where it cannot be built (one warning, with the compiler's log)."""
    from torch.utils.cpp_extension import load

    arch, build = cpu_arch(), build_dir()
    failure, log = build / "failed", build / "build.log"
    if failure.is_file() and failure.read_text() == build_fingerprint(arch):
        warn_failed(arch, log, "(remembered)")
        return None
    try:
        if shutil.which("ninja") is None:  # pip's ninja lives beside this interpreter, which may not be on PATH
            import ninja
            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"
        build.mkdir(parents=True, exist_ok=True)
        # A build killed midway leaves a "lock" file in the folder that stalls the next one: delete it then.
        logger.info("loading the CPU kernels from %s (the first time builds them)", build)
        module = load("nanoengine_cpu_kernels", [str(s) for s in KERNEL_SOURCES], extra_cflags=kernel_flags(arch),
                      extra_ldflags=["-fopenmp"], build_directory=str(build))
    except (OSError, RuntimeError, ImportError, subprocess.SubprocessError) as error:
        log.write_text(str(error))
        failure.write_text(build_fingerprint(arch))
        warn_failed(arch, log)
        return None
    failure.unlink(missing_ok=True)
    return module


def warn_failed(arch: str, log: Path, remembered: str = "") -> None:
    logger.warning("the CPU kernels could not be built for -march=%s %s(compiler log: %s); every op takes its "
                   "slower torch path. Install a C++ compiler, or set %s (for example x86-64-v3)",
                   arch, f"{remembered} " if remembered else "", log, ARCH_VARIABLE)


def isa_of(arch: str) -> list[str]:
    """The instruction sets of REPORTED_ISA that the compiler enables for ``-march=arch`` (empty without one)."""
    try:
        macros = subprocess.run([compiler(), f"-march={arch}", "-dM", "-E", "-x", "c++", os.devnull],
                                capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    defined = {line.split()[1].strip("_").lower() for line in macros.splitlines() if line.startswith("#define __")}
    return [isa for isa in REPORTED_ISA if isa in defined]


def check_compiles(arch: str) -> None:
    """Compile every source for ``-march=arch`` without building, for a level this CPU cannot run: raises
    CalledProcessError, with the compiler's errors on stderr, where one does not compile."""
    import sysconfig

    from torch.utils.cpp_extension import include_paths

    includes = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    compiles = [[compiler(), "-std=c++17", "-fsyntax-only", *kernel_flags(arch), *includes,
                 "-DTORCH_EXTENSION_NAME=nanoengine_cpu_kernels", str(source)] for source in KERNEL_SOURCES]
    running = [(command, subprocess.Popen(command)) for command in compiles]  # all at once: every core helps
    for command, process in running:
        if process.wait():
            raise subprocess.CalledProcessError(process.returncode, command)
