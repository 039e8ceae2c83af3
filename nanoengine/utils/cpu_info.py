"""What the CPU is: its model name and its instruction-set flags, read from /proc/cpuinfo (Linux)."""

from pathlib import Path


def cpuinfo_field(name: str) -> str:
    """The first value of ``name`` in /proc/cpuinfo, or "" where there is no such file or field."""
    path = Path("/proc/cpuinfo")
    for line in path.read_text().splitlines() if path.is_file() else []:
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


def cpu_model() -> str:
    return cpuinfo_field("model name") or "unknown CPU"


def cpu_flags() -> set[str]:
    return set(cpuinfo_field("flags").split())
