"""``nanoengine cpu-info [--json]``: the CPU, the ``-march`` the kernels are built for (NANOENGINE_CPU_ARCH), the
instruction sets that build uses, and which kernels are active. It builds or loads the kernels as any start does
(a remembered failure included), and exits 0 either way."""

import argparse
import json

from nanoengine.platforms.cpu import build
from nanoengine.utils.cpu_info import cpu_model

# The extension's ops the CPU platform swaps in (platforms/cpu/), and the linear kernel's weight types.
KERNEL_OPS = ("decode_attention", "prefill_attention", "store_kv", "rms_norm", "add_rms_norm", "silu_and_mul",
              "rotary", "argmax", "decoder_layers")
LINEAR_DTYPES = ("float32", "bfloat16", "int8")


def report() -> dict:
    kernels = build.load_cpu_kernels()
    arch = build.cpu_arch()
    active = {name: kernels is not None and hasattr(kernels, name) for name in KERNEL_OPS}
    dtypes = kernels.linear_dtypes() if kernels is not None else []
    active |= {f"linear_{dtype}": dtype in dtypes for dtype in LINEAR_DTYPES}
    return {"cpu": cpu_model(), "march": arch, "isa": build.isa_of(arch),
            "vector_section": kernels.vector_isa() if kernels is not None else None,
            "build": str(build.build_dir()), "kernels": active}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nanoengine cpu-info", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    info = report()
    if parser.parse_args(argv).json:
        print(json.dumps(info))
        return 0
    for key, value in info.items():
        if key == "kernels":
            value = " ".join(f"{name}{'' if on else ' (off)'}" for name, on in value.items())
        elif key == "isa":
            value = " ".join(value)
        print(f"{key:15} {value}")
    return 0
