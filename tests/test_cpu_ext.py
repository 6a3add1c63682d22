"""The cpu C++ kernels' library is loud when it cannot be used: its build stamp (torch version, hash of csrc/cpu/)
marks a library built for another torch or from other sources as stale, and the cpu platform's default kernels warn
once without a usable library, or refuse to start under GRAPHINFER_REQUIRE_CPU_KERNELS=1."""
import json
import logging

import pytest
import torch

from graphinfer import LLM
from graphinfer.errors import CpuKernelsMissingError, GraphinferError
from graphinfer.ops.cpu import ext
from graphinfer.platforms import cpu as cpu_platform
from graphinfer.platforms import get_platform
from conftest import need_cpu_kernels


@pytest.fixture
def fake_tree(tmp_path, monkeypatch):
    """ext pointed at a library path and a csrc/cpu/ of tmp_path (nothing built there); its load result and the
    platform's warn-once forgotten before and after (the real library, if loaded, stays loaded: dlopen is
    idempotent)."""
    src = tmp_path / "csrc" / "cpu"
    src.mkdir(parents=True)
    (src / "kernel.cpp").write_text("// v1\n")
    (src / "vec.h").write_text("// header\n")
    monkeypatch.setattr(ext, "SOURCE_DIR", src)
    monkeypatch.setattr(ext, "LIBRARY", tmp_path / "_cpu_kernels.so")
    monkeypatch.setattr(ext, "STAMP", tmp_path / "_cpu_kernels.so.stamp")
    monkeypatch.delenv("GRAPHINFER_REQUIRE_CPU_KERNELS", raising=False)
    ext.problem.cache_clear()
    cpu_platform._warn_once.cache_clear()
    yield src
    monkeypatch.undo()
    ext.problem.cache_clear()
    cpu_platform._warn_once.cache_clear()
    get_platform("cpu").activate("reference")  # later tests call the ops directly


def _stamp(**fields) -> None:
    ext.STAMP.write_text(json.dumps({"torch": torch.__version__, "sources": ext.source_hash(), **fields}))


def test_stamp_with_other_sources_or_torch_is_stale(fake_tree):
    ext.LIBRARY.write_bytes(b"")
    assert ext.stale_reason() == "stale (no readable build stamp _cpu_kernels.so.stamp)"
    _stamp()
    assert ext.stale_reason() is None
    (fake_tree / "vec.h").write_text("// header, edited after the build\n")  # a header counts too
    assert ext.stale_reason() == "stale (built from other csrc/cpu/ sources than these)"
    assert ext.problem() == "stale (built from other csrc/cpu/ sources than these)"  # not loaded
    _stamp(torch="2.11.0")
    assert ext.stale_reason() == f"stale (built for torch 2.11.0, this is {torch.__version__})"


def test_a_current_stamp_on_a_broken_library_fails_to_load(fake_tree):
    ext.LIBRARY.write_bytes(b"not an ELF file")
    _stamp()
    assert ext.problem().startswith("failed to load (") and not ext.available()


def test_build_records_torch_and_the_sources_hash(fake_tree):
    """The stamp holds the hash of the sources as compiled (a compiler that does nothing: `true`)."""
    want = ext.source_hash()
    ext.build("true")
    assert json.loads(ext.STAMP.read_text()) == {"torch": torch.__version__, "sources": want}
    (fake_tree / "kernel.cpp").write_text("// v2\n")
    assert ext.source_hash() != want


def test_missing_library_warns_once_naming_the_cost_and_the_fix(fake_tree, caplog):
    platform = get_platform("cpu")
    with caplog.at_level(logging.WARNING, logger="graphinfer.platforms.cpu"):
        platform.activate("eager")
        assert platform.kernels["paged_attention"] == "graphinfer.ops.cpu.attention"  # it runs, on the fallbacks
        platform.activate("inductor")
        platform.activate("reference")  # asked for the PyTorch ops: nothing to say
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    message = warnings[0].getMessage()
    assert "not built" in message and str(ext.LIBRARY) in message
    assert "PyTorch fallbacks, ~2x slower on the peer workload" in message
    assert "`make venv`" in message and "`python -m graphinfer.ops.cpu.ext`" in message


def test_required_kernels_missing_is_a_typed_error(fake_tree, monkeypatch, tiny_checkpoint):
    monkeypatch.setenv("GRAPHINFER_REQUIRE_CPU_KERNELS", "1")
    platform = get_platform("cpu")
    with pytest.raises(CpuKernelsMissingError, match=r"not built.*python -m graphinfer\.ops\.cpu\.ext") as err:
        platform.activate("eager")
    assert isinstance(err.value, GraphinferError) and "GRAPHINFER_REQUIRE_CPU_KERNELS=1" in str(err.value)
    platform.activate("reference")  # the PyTorch ops by choice need no library
    # the engine's start-up, with the cpu platform's default kernels
    monkeypatch.delenv("GRAPHINFER_CPU_KERNELS", raising=False)
    with pytest.raises(CpuKernelsMissingError):
        LLM(tiny_checkpoint("llama")[0], device="cpu")


def test_kernel_tests_fail_rather_than_skip_when_required(fake_tree, monkeypatch):
    with pytest.raises(pytest.skip.Exception, match="not built"):
        need_cpu_kernels(False)
    monkeypatch.setenv("GRAPHINFER_REQUIRE_CPU_KERNELS", "1")
    with pytest.raises(pytest.fail.Exception, match="GRAPHINFER_REQUIRE_CPU_KERNELS=1"):
        need_cpu_kernels(False)
    need_cpu_kernels(True)

