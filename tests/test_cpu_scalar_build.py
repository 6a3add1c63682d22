"""The C++ kernels as built for any x86-64 (`make venv` builds _cpu_kernels_scalar.so: -march=x86-64, ATen's scalar
vector types, the code paths a CPU without AVX runs), loaded instead of the native build
(GRAPHINFER_CPU_KERNELS_BUILD=scalar) in a fresh pytest that runs the kernels' own tests against their references."""
import os
import subprocess
import sys

import pytest

from graphinfer import envs

KERNEL_TESTS = ["tests/test_cpu_attention.py", "tests/test_cpu_elementwise.py", "tests/test_cpu_gemv.py",
                "tests/test_cpu_quant_a8.py", "tests/test_cpu_quant_kernels.py", "tests/test_fused_quant_codes.py",
                "tests/test_cpu_sampling.py"]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBE = """
import torch
from graphinfer.ops.cpu import ext
problem = ext.problem()
print(problem or f"{ext.LIBRARY.name} isa {torch.ops.graphinfer_cpu_quant.wo_linear_a8_isa()}")
"""


def test_kernel_tests_pass_on_the_scalar_build():
    env = {**os.environ, "GRAPHINFER_CPU_KERNELS_BUILD": "scalar", "GRAPHINFER_REQUIRE_CPU_KERNELS": "1"}
    probe = subprocess.run([sys.executable, "-c", PROBE], env=env, cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert probe.returncode == 0, probe.stderr[-3000:]
    loaded = probe.stdout.strip()
    if not loaded.startswith("_cpu_kernels_scalar.so"):  # not built or stale: as conftest.need_cpu_kernels
        reason = f"scalar cpu kernels {loaded}: python -m graphinfer.ops.cpu.ext --build scalar"
        if envs.GRAPHINFER_REQUIRE_CPU_KERNELS == "1":
            pytest.fail(f"{reason} (GRAPHINFER_REQUIRE_CPU_KERNELS=1)", pytrace=False)
        pytest.skip(reason)
    assert loaded == "_cpu_kernels_scalar.so isa 0"  # the int8-activation kernel runs its scalar path
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-n", "0",
                          *KERNEL_TESTS], env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-2000:]
