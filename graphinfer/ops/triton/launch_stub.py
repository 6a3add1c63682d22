"""A CPU stand-in for a device's Triton runtime: the host side of every launch runs, the kernels do nothing.

For measuring and testing launch overhead without a GPU (tools/profile_host_step.py, tests/test_triton_launch.py).
Inside `stub_triton_runtime()`:

* Triton's active driver is a stub that reports device 0, stream 0 and a target of the installed Triton's
  device backend ("cuda" sm_90 for upstream Triton, "npu" for Triton-Ascend), so `JITFunction.run` and
  graphinfer's `Launcher` take their real device paths (Triton's binder, cache keys, option parsing);
* compiling is replaced by making a `StubKernel` (a CompiledKernel whose launcher records the call and returns),
  cached by Triton under its own key exactly where a compiled kernel would be.

Kernels must be real JITFunctions, i.e. decorated without TRITON_INTERPRET=1. Outputs of the stubbed kernels
are whatever torch.empty left there. Not for a process that launches real kernels: refused where CUDA exists.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field

import torch
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import CompiledKernel
from triton.runtime.driver import DriverBase, driver
from triton.runtime.jit import JITFunction

from graphinfer.ops.triton import launch


def _is_ascend() -> bool:
    try:
        import triton.backends.ascend  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class StubRuntime:
    """What happened inside the stub: compiles, JITFunction.run calls, and (record=True) every launch."""
    record: bool = False
    compiles: int = 0
    jit_runs: int = 0
    jit_runs_by_kernel: dict = field(default_factory=dict)  # kernel function name -> JITFunction.run calls
    launches: int = 0
    calls: list = field(default_factory=list)  # (kernel name, args given to the compiled kernel's launcher)
    kernels: list = field(default_factory=list)  # the StubKernels made, in order


class _StubDriver(DriverBase):
    def __init__(self, target: GPUTarget):
        super().__init__()
        self.target = target

    @classmethod
    def is_active(cls):
        return False

    def map_python_to_cpp_type(self, ty):
        return ty

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


class _StubLauncher:
    """Takes the place of the generated C launcher (CudaLauncher / NPULauncher): records, launches nothing."""

    def __init__(self, name: str, runtime: StubRuntime):
        self.name, self.runtime = name, runtime

    def __call__(self, *args):
        self.runtime.launches += 1
        if self.runtime.record:
            self.runtime.calls.append((self.name, args))


_handles = itertools.count(1)


class StubKernel(CompiledKernel):
    """A compiled kernel without a binary: what `launch_metadata` and the launch path read, nothing more."""

    def __init__(self, fn, signature, constants, options, runtime: StubRuntime):  # noqa: no super().__init__
        self.src = None  # launch_metadata: not an ASTSource -> no user launch_metadata callback
        self.name = fn.__name__
        self.signature, self.constants, self.options = signature, constants, options
        self.module = "stub"  # _init_handles: already loaded
        self.function = next(_handles)  # a distinct CUfunction-like handle per compiled kernel
        self.packed_metadata = (getattr(options, "num_warps", 4), getattr(options, "num_ctas", 1),
                                getattr(options, "shared", 0))
        launcher = _StubLauncher(self.name, runtime)
        if isinstance(getattr(CompiledKernel, "run", None), property):  # upstream 3.x: run is a property over _run
            self._run = launcher
        else:  # Triton-Ascend 3.2: _init_handles sets self.run
            self.run = launcher


@contextlib.contextmanager
def stub_triton_runtime(record: bool = False, count_jit_runs: bool = True):
    """Run Triton launches against the stub (see the module docstring); yields the StubRuntime."""
    if torch.cuda.is_available():
        raise RuntimeError("stub_triton_runtime replaces the Triton runtime of a machine without a GPU only")
    ascend = _is_ascend()
    rt = StubRuntime(record)
    target = GPUTarget("npu", "Ascend910B3", 0) if ascend else GPUTarget("cuda", 90, 32)
    saved_driver = dict(vars(driver))
    patched: list[tuple[object, str, object]] = []

    def patch(obj, name, value):
        patched.append((obj, name, obj.__dict__[name] if name in obj.__dict__ else None))
        setattr(obj, name, value)

    touched = {id(lc.kernel): lc.kernel for lc in launch.all_launchers() if isinstance(lc.kernel, JITFunction)}

    def make(fn, signature, constants, options):
        touched[id(fn)] = fn
        rt.compiles += 1
        kernel = StubKernel(fn, signature, constants, options, rt)
        rt.kernels.append(kernel)
        return kernel

    if ascend:  # 3.2 compiles inline in run through self.compile = triton.compiler.compile (set by create_binder)
        import triton.compiler as compiler_pkg

        def stub_compile(src, target=None, options=None):
            return make(src.fn, src.signature, src.constants, options and _Options(options))

        patch(compiler_pkg, "compile", stub_compile)
    else:  # upstream 3.6: JITFunction._do_compile(key, signature, device, constexprs, options, attrs, warmup)
        def stub_do_compile(self, key, signature, device, constexprs, options, attrs, warmup):
            kernel = make(self, signature, constexprs, options)
            self.device_caches[device][0][key] = kernel
            return kernel

        patch(JITFunction, "_do_compile", stub_do_compile)
    if count_jit_runs:
        real_run = JITFunction.run

        def counted_run(self, *args, **kwargs):
            rt.jit_runs += 1
            name = self.fn.__name__
            rt.jit_runs_by_kernel[name] = rt.jit_runs_by_kernel.get(name, 0) + 1
            return real_run(self, *args, **kwargs)

        patch(JITFunction, "run", counted_run)
    driver.set_active(_StubDriver(target))
    for fn in touched.values():
        _forget(fn)
    launch.reset_launchers()
    try:
        yield rt
    finally:
        for obj, name, old in reversed(patched):
            if old is None:
                delattr(obj, name)
            else:
                setattr(obj, name, old)
        vars(driver).clear()
        vars(driver).update(saved_driver)
        for fn in touched.values():
            _forget(fn)
        launch.reset_launchers()


class _Options:
    """Attribute view of a compile options dict (Ascend passes options.__dict__ to compile)."""

    def __init__(self, d: dict):
        self.__dict__.update(d)


def _forget(fn) -> None:
    """Drop a JITFunction's per-device caches (binder, compiled kernels) so stub kernels never outlive the stub."""
    if hasattr(fn, "device_caches"):
        fn.device_caches.clear()
    if hasattr(fn, "cache") and isinstance(fn.cache, dict):
        fn.cache.clear()
    if hasattr(fn, "binder"):
        fn.binder = None


__all__ = ["StubKernel", "StubRuntime", "stub_triton_runtime"]
