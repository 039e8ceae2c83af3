"""Building the CPU kernels: one folder per -march, a failure remembered until what it depends on changes, and
`nanoengine cpu-info`'s report."""

import json
import subprocess
import sys

import pytest

from nanoengine.cli import main
from nanoengine.platforms.cpu import build
from nanoengine.utils.cpu_info import cpu_flags


@pytest.fixture
def no_compiler(monkeypatch, tmp_path):
    """A fresh cache, and an extension builder that fails as a machine without a compiler does; yields the
    number of times it was called."""
    monkeypatch.setenv("NANOENGINE_CACHE", str(tmp_path))
    monkeypatch.delenv("NANOENGINE_CPU_ARCH", raising=False)
    monkeypatch.delenv("CXX", raising=False)
    calls = []

    def fail(*args, **kwargs):
        calls.append(kwargs["extra_cflags"])
        raise RuntimeError("c++: command not found")

    monkeypatch.setattr("torch.utils.cpp_extension.load", fail)
    return calls


def test_a_failed_build_warns_once_with_its_log_and_is_not_tried_again(no_compiler, caplog):
    assert build.load_cpu_kernels() is None
    [warning] = caplog.records
    log = build.build_dir() / "build.log"
    assert f"compiler log: {log}" in warning.message and "NANOENGINE_CPU_ARCH" in warning.message
    assert "c++: command not found" in log.read_text()
    assert build.load_cpu_kernels() is None
    assert len(no_compiler) == 1, "a remembered failure is not built again"
    assert "(remembered)" in caplog.records[-1].message


def test_a_failed_build_is_tried_again_when_the_compiler_or_the_march_changes(no_compiler, monkeypatch):
    build.load_cpu_kernels()
    monkeypatch.setenv("CXX", "g++")
    build.load_cpu_kernels()
    monkeypatch.setenv("NANOENGINE_CPU_ARCH", "x86-64-v3")
    build.load_cpu_kernels()
    assert [flags[1] for flags in no_compiler] == ["-march=native", "-march=native", "-march=x86-64-v3"]


def test_each_march_builds_in_its_own_folder_with_its_own_linear_choices(monkeypatch):
    folders = {build.build_dir(arch) for arch in ("native", "x86-64-v3", "x86-64-v2")}
    assert len(folders) == 3
    monkeypatch.setenv("NANOENGINE_CPU_ARCH", "x86-64-v3")
    assert build.build_dir().name.startswith("x86-64-v3-")


def test_the_isa_of_each_level_is_the_compilers():
    assert {"avx2", "fma", "f16c"} <= set(build.isa_of("x86-64-v3"))
    assert not {"avx512f", "avx512bf16"} & set(build.isa_of("x86-64-v3"))
    assert {"avx2", "avx512f", "avx512bw", "avx512vl"} <= set(build.isa_of("x86-64-v4"))
    assert "avx2" not in build.isa_of("x86-64-v2")
    assert build.isa_of("no-such-cpu") == []


# The scalar section (x86-64-v2), and the levels this CPU cannot run (the ones it runs are built and tested by
# .ci/run, which runs the kernels' tests at each).
UNRUNNABLE_LEVELS = ["x86-64-v2"] + ["x86-64-v3"] * ("avx2" not in cpu_flags()) + ["x86-64-v4"] * (
    "avx512f" not in cpu_flags())


@pytest.mark.parametrize("arch", UNRUNNABLE_LEVELS)
def test_the_kernels_compile_at_a_level_this_cpu_does_not_run(arch):
    build.check_compiles(arch)


def test_cpu_info_reports_every_kernel_active_in_the_vector_section_of_the_build(capsys):
    assert main(["cpu-info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["march"] == build.cpu_arch() and info["isa"] == build.isa_of(info["march"])
    section = "avx512" if "avx512f" in info["isa"] else "avx2" if "avx2" in info["isa"] else "scalar"
    assert info["vector_section"] == section
    assert info["kernels"] and all(info["kernels"].values()), info["kernels"]


def test_cpu_info_without_a_compiler_exits_0_with_every_kernel_off(tmp_path):
    env = {"NANOENGINE_CACHE": str(tmp_path), "CXX": "/bin/false", "PATH": "/usr/bin:/bin"}
    command = "import sys; from nanoengine.cli import main; sys.exit(main(['cpu-info', '--json']))"
    done = subprocess.run([sys.executable, "-c", command], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert info["vector_section"] is None and not any(info["kernels"].values())
    assert "could not be built" in done.stderr
