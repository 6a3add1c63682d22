"""Platform selection (GRAPHINFER_PLATFORM, detection, entry-point plugins) and op-impl registration."""
import os
import platform
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import graphinfer.platforms as platforms
from graphinfer.errors import InvalidConfigError
from graphinfer.platforms import Platform, current_platform, get_platform, platform_for_device


@pytest.fixture(autouse=True)
def fresh_platform_cache():
    get_platform.cache_clear()
    yield
    get_platform.cache_clear()


def test_detection_on_this_machine(monkeypatch):
    monkeypatch.delenv("GRAPHINFER_PLATFORM", raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert current_platform().name == expected
    assert platform_for_device("cpu").name == "cpu" and platform_for_device("cuda").dist_backend == "nccl"
    assert get_platform("npu").dist_backend == "hccl" and get_platform("cpu").dist_backend == "gloo"


def test_env_var_selects_and_unknown_names_fail(monkeypatch):
    monkeypatch.setenv("GRAPHINFER_PLATFORM", "cpu")
    assert current_platform().name == "cpu"
    monkeypatch.setenv("GRAPHINFER_PLATFORM", "tpu")
    with pytest.raises(InvalidConfigError, match="Unknown platform 'tpu'; available: .*cuda"):
        current_platform()
    with pytest.raises(InvalidConfigError, match="No graphinfer platform runs torch device type 'xla'"):
        platform_for_device("xla")


class _PluginPlatform(Platform):
    name = "myaccel"
    device_type = "cpu"
    dispatch_key = "CPU"

    @classmethod
    def is_available(cls):
        return True


def _entry_points(value):
    ep = SimpleNamespace(name="myaccel", value="my_pkg:Plat", load=lambda: value)
    return lambda group: [ep] if group == "graphinfer.platforms" else []


def test_plugin_platform_from_entry_points_is_detected_first(monkeypatch):
    monkeypatch.delenv("GRAPHINFER_PLATFORM", raising=False)
    monkeypatch.setattr(platforms, "entry_points", _entry_points(_PluginPlatform))
    assert list(platforms.available_platforms())[0] == "myaccel"
    assert isinstance(current_platform(), _PluginPlatform)


def test_broken_plugin_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(platforms, "entry_points", _entry_points(object))
    with pytest.raises(InvalidConfigError, match="not a graphinfer.platforms.Platform subclass"):
        platforms.available_platforms()


def test_activate_registers_and_replaces_impls_under_the_dispatch_key():
    """A platform's impls take over for its dispatch key; a second activation replaces the first."""
    import graphinfer.ops  # noqa: F401

    x = torch.randn(3, 8)

    class Doubled(_PluginPlatform):
        def op_impls(self, kernels=None):
            return {} if kernels == "reference" else {"silu_and_mul": lambda t: torch.full_like(t[:, :4], 7.0)}

    p = Doubled()
    try:
        p.activate()
        assert torch.equal(torch.ops.graphinfer.silu_and_mul(x), torch.full((3, 4), 7.0))
        p.activate("reference")
        expected = torch.nn.functional.silu(x[:, :4]) * x[:, 4:]
        assert torch.allclose(torch.ops.graphinfer.silu_and_mul(x), expected)
    finally:
        p.activate("reference")


def test_cpu_activation_keeps_a_tensor_parallel_rank_to_its_share_of_the_cores(monkeypatch):
    """A worker rank activates its platform after joining the group: it must not take every core back."""
    from graphinfer.distributed import parallel_state as ps
    from graphinfer.platforms.cpu import CpuPlatform, physical_cores

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    saved = torch.get_num_threads()
    try:
        monkeypatch.setattr(ps._state, "ranks_per_node", 2)
        CpuPlatform().activate("reference")
        assert torch.get_num_threads() == max(1, physical_cores() // 2)
        monkeypatch.setattr(ps._state, "ranks_per_node", 1)
        CpuPlatform().activate("reference")
        assert torch.get_num_threads() == physical_cores()
    finally:
        CpuPlatform().activate("reference")  # the conftest default: reference ops under the CPU key
        torch.set_num_threads(saved)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux-only")
def test_physical_cores_survive_openmp_binding():
    """OMP_PROC_BIND / GOMP_CPU_AFFINITY make libgomp pin the main thread to one CPU as torch loads: graphinfer's
    thread count must still see every core the process was given."""
    code = ("import graphinfer, torch; from graphinfer.platforms.cpu import physical_cores; "
            "torch.ones(256, 256) @ torch.ones(256, 256); print(physical_cores())")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    counts = [subprocess.run([sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
                             check=True, timeout=300).stdout.strip()
              for extra in ({}, {"OMP_PROC_BIND": "true"}, {"GOMP_CPU_AFFINITY": "0-1023"})]
    assert counts[0] == counts[1] == counts[2], counts


_FAULTS_PER_REALLOCATION = """
import resource, torch
from graphinfer.platforms.cpu import CpuPlatform
CpuPlatform().activate("reference")
faults = []
for _ in range(10):  # a layer's large activations (64 and 32 MB), allocated and freed layer after layer
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x, y = torch.ones(16 * 2**20), torch.ones(8 * 2**20)
    del x, y
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(min(faults[-4:]))  # once the heap has settled
"""


@pytest.mark.skipif(sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc malloc only")
def test_cpu_platform_keeps_freed_memory_so_large_activations_are_not_faulted_in_again():
    """GRAPHINFER_CPU_RETAIN_FREED_MEMORY: by default reallocated blocks are served from the heap already mapped
    (once the heap has grown to the peak); with 0 (glibc's defaults) each is a fresh mmap, page-faulted in again
    (24,576 pages of 4 KiB)."""
    def faults(setting: str) -> int:
        out = subprocess.run([sys.executable, "-c", _FAULTS_PER_REALLOCATION], capture_output=True, text=True,
                             env={**os.environ, "GRAPHINFER_CPU_RETAIN_FREED_MEMORY": setting}, check=True,
                             timeout=300)
        return int(out.stdout.split()[-1])

    assert faults("1") < 1000
    assert faults("0") > 12000  # fewer than 24,576 where the kernel maps huge pages


def test_importing_graphinfer_does_not_import_torch_npu_or_triton():
    code = ("import sys, graphinfer, graphinfer.platforms, graphinfer.ops; "
            "from graphinfer.platforms import current_platform; current_platform(); "
            "print('torch_npu' in sys.modules, 'triton' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         timeout=300).stdout.split()
    assert out == ["False", "False"]
