"""Cheap Triton launches for the eager path: each kernel bound once per specialisation to its compiled kernel.

`kernel[grid](*args, **kw)` goes through `JITFunction.run` on every call: Triton's binder specialises every
argument (one `native_specialize_impl` call each in 3.6) into a list, the options dict is rebuilt and turned
into a string key, knobs, hooks and used globals are re-checked, the grid is canonicalised, launch metadata is
built (in 3.6 a LazyDict whose hooks the C launcher then calls even when none is installed), and Triton-Ascend
3.2 also re-creates the backend and reads the environment. `Launcher` replaces that, after the first launch
of a specialisation, by one tuple key, one dict lookup and a direct call of the compiled kernel's launcher
(`CompiledKernel.run`, the object `run` itself calls) with the arguments `run` would pass it.

The key. Per call the Launcher builds, from the arguments as given (a per-kernel generated function):
  * a tensor (any torch.Tensor): (dtype, data_ptr() & 15)  -- Triton specialises a pointer on its dtype (and
    the parameter's const-ness, fixed per kernel) and on 16-byte alignment only;
  * an int: the value itself -- it determines everything Triton derives from it (== 1, % 16, i32/i64/u64);
  * a float: the marker `float` -- Triton passes non-constexpr floats as fp32 without specialising the value;
  * a constexpr parameter, and anything else: (type, value);
  * every keyword (constexprs and options such as num_warps): name, value and type;
  * the current device, and what `run` adds to the options: the kernel's and knobs' `debug` and the
    instrumentation mode (3.6), or TRITON_DEBUG (Triton-Ascend 3.2).
Two calls with equal keys therefore get the same specialisation from Triton, whatever its exact rules for
ints; the rules relied on for tensors and floats are the ones in native_specialize_impl (3.6) and
mangle_type / AttrsDescriptor.get_property_key (3.2), checked against them in tests/test_triton_launch.py.
Different keys may still share a compiled kernel (e.g. two row counts that are both multiples of 16): each
costs one ordinary launch, then is bound too.

Kernels mark their per-step counts (rows, requests, tiles) `do_not_specialize`: Triton would otherwise compile
one variant per class (== 1, % 16 == 0, other) of each count, i.e. up to 27 for the flash-attention kernel,
each a JIT of about a second on an H100 paid by whichever eager step first meets it. (On the H100 the
FULL_DECODE_ONLY standard workload at max_num_seqs 64 spent 26.5 s in its 188 prompt-carrying eager steps,
FULL_AND_PIECEWISE 3.9 s after its capture warm-ups had compiled the kernels; not yet re-measured with this.)

Binding. A key seen for the first time launches through `run` itself (which compiles if needed). Then Triton's
own key for the call is computed with Triton's own code (3.6: the kernel's binder + `compute_cache_key`; 3.2:
`fn.binder` + `''.join(sig_and_spec) + str((constexpr_vals, excess_kwargs))`), and the key is bound only if
the kernel `run` returned is the object Triton cached under that key and the argument list rebuilt here is
identical (element by element) to the binder's. GRAPHINFER_TRITON_FAST_LAUNCH=check repeats that comparison
on every launch and raises on a difference (for a device run that validates the keys; slower than normal).

Everything else takes the normal `kernel[grid](...)` path: a Triton version or backend not listed in
_UPSTREAM / _ASCEND (upstream 3.6 with backend "cuda", Triton-Ascend 3.2 with "npu"), interpreted kernels
(TRITON_INTERPRET=1), a grid that is not a tuple, pre-run hooks or launch hooks installed (profilers),
unhashable arguments, any exception while binding (logged once per kernel at DEBUG), and
GRAPHINFER_TRITON_FAST_LAUNCH=0.
"""
from __future__ import annotations

import logging
import os

import torch
import triton

from graphinfer import envs

log = logging.getLogger(__name__)

ENV = "GRAPHINFER_TRITON_FAST_LAUNCH"
_UPSTREAM = {(3, 6)}  # upstream versions whose JITFunction.run / launcher calls _launch_upstream mirrors
_ASCEND = {(3, 2)}  # Triton-Ascend versions whose JITFunction.run _launch_ascend mirrors
_MAX_BINDINGS = 4096  # per kernel; int arguments are keyed by value, so prefill row counts add up


def _env_mode() -> str:
    value = envs.get(ENV).strip().lower()
    if value == "check":
        return "check"
    return "off" if value in ("0", "false", "off", "no") else "on"


_switch = {"mode": _env_mode()}


def fast_launch_mode() -> str:
    """'on', 'off' or 'check' (GRAPHINFER_TRITON_FAST_LAUNCH=1 / 0 / check; default on)."""
    return _switch["mode"]


def set_fast_launch(mode: str | bool | None) -> str:
    """Set the mode for this process (True/'on', False/'off', 'check'; None: back to the environment
    variable); returns the previous mode. For tools and tests that compare the paths in one process."""
    previous = _switch["mode"]
    if mode is None:
        mode = _env_mode()
    elif mode is True or mode is False:
        mode = "on" if mode else "off"
    if mode not in ("on", "off", "check"):
        raise ValueError(f"fast launch mode {mode!r}: use 'on', 'off' or 'check'")
    _switch["mode"] = mode
    return previous


def _version() -> tuple[int, int]:
    major, minor = triton.__version__.split(".")[:2]
    return int(major), int(minor)


def triton_flavour() -> str | None:
    """'upstream' or 'ascend' where this module knows the installed Triton's launch path, else None.
    Needs an active driver (a GPU or NPU, or the tests' stand-in); None when there is none."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return None
    try:
        from triton.runtime.driver import driver

        backend = driver.active.get_current_target().backend
        version = _version()
    except Exception:  # noqa: BLE001 -- no device, no driver, an odd version string
        return None
    if backend == "cuda" and version in _UPSTREAM:
        return "upstream"
    if backend == "npu" and version in _ASCEND:
        return "ascend"
    return None


def next_power_of_2(n: int) -> int:
    """triton.next_power_of_2 for host code: in Triton 3.6 that (and triton.cdiv) is a ConstexprFunction whose
    call costs microseconds; wrappers call these per launch."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _other_key(a):
    """Key of an argument that is neither an int nor an exact torch.Tensor (see the module docstring)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() & 15)
    if a.__class__ is float:
        return float
    return (a.__class__, a)


def _make_key_fn(params, nargs: int):
    """key(p0, p1, p2, p3, args, kw) -> the launch key for calls with `nargs` positional arguments."""
    if nargs > len(params):
        return None
    items = []
    for i in range(nargs):
        a = f"a{i}"
        if params[i].is_constexpr:
            items.append(f"({a}.__class__, {a})")
        else:
            items.append(f"({a} if {a}.__class__ is int else ({a}.dtype, {a}.data_ptr() & 15) "
                         f"if {a}.__class__ is Tensor else other({a}))")
    unpack = f"    {''.join(f'a{i}, ' for i in range(nargs))}= args\n" if nargs else ""
    src = (f"def key(p0, p1, p2, p3, args, kw):\n{unpack}"
           f"    return (p0, p1, p2, p3, {''.join(x + ', ' for x in items)}*kw.items(), *map(type, kw.values()))\n")
    namespace = {"Tensor": torch.Tensor, "other": _other_key}
    exec(src, namespace)  # noqa: S102 -- generated from parameter positions only, as Triton's own binder
    return namespace["key"]


def _make_assembler(params, nargs: int, kw_names: tuple, only_runtime: bool):
    """assemble(args, kw) -> the values the compiled kernel's launcher takes after its fixed arguments: every
    parameter in order (upstream 3.6) or the non-constexpr ones (Triton-Ascend 3.2). None if a parameter is
    neither given nor defaulted (the binder would refuse the call too)."""
    exprs, namespace = [], {}
    for i, p in enumerate(params):
        if only_runtime and p.is_constexpr:
            continue
        if i < nargs:
            exprs.append(f"args[{i}]")
        elif p.name in kw_names:
            exprs.append(f"kw[{p.name!r}]")
        elif p.has_default:
            namespace[f"default{i}"] = p.default
            exprs.append(f"default{i}")
        else:
            return None
    if exprs == [f"args[{i}]" for i in range(nargs)]:
        return _positional
    exec(f"def assemble(args, kw):\n    return ({''.join(e + ', ' for e in exprs)})\n", namespace)  # noqa: S102
    return namespace["assemble"]


def _positional(args, kw):
    return args


_LAUNCHERS: list[Launcher] = []  # every Launcher made (one per kernel, at import): for reset_launchers()


def all_launchers() -> list[Launcher]:
    return list(_LAUNCHERS)


def reset_launchers() -> None:
    """Forget every Launcher's bindings and path choice (after the Triton runtime was swapped, e.g. in tests)."""
    for launcher in _LAUNCHERS:
        launcher.reset()


class Launcher:
    """`Launcher(kernel)(grid, *args, **kwargs)` launches like `kernel[grid](*args, **kwargs)`, cheaply.

    Make one per kernel at import time, next to the kernel. The path is chosen at the first launch (when a
    device exists). `bindings`: launch key -> (launcher, function handle, packed metadata, assembler, Triton's key).
    """

    __slots__ = ("kernel", "bindings", "launch", "_key_fns", "_rt", "_compiled_kernel", "_logged")

    def __init__(self, kernel):
        self.kernel = kernel
        self._logged = False
        self.reset()
        _LAUNCHERS.append(self)

    def __call__(self, grid, *args, **kwargs):
        return self.launch(grid, *args, **kwargs)

    def __repr__(self) -> str:
        return f"Launcher({self.kernel!r}, {self.launch.__name__})"

    def reset(self) -> None:
        """Forget the bindings and choose the path again at the next launch."""
        self.bindings: dict = {}
        self._key_fns: dict = {}
        self.launch = self._first_launch

    def _debug_once(self, msg: str, *args) -> None:
        if not self._logged:
            self._logged = True
            log.debug(msg, *args)

    # ----- choosing the path -----
    def _first_launch(self, grid, *args, **kwargs):
        self.launch = self._choose()
        return self.launch(grid, *args, **kwargs)

    def _choose(self):
        from triton.runtime.jit import JITFunction

        if not isinstance(self.kernel, JITFunction):  # interpreted (TRITON_INTERPRET=1) or wrapped (autotuner)
            return self._launch_normal
        flavour = triton_flavour()
        try:
            from triton.compiler.compiler import CompiledKernel
            from triton.runtime.driver import driver

            self._compiled_kernel = CompiledKernel
            if flavour == "upstream":
                from triton import knobs
                from triton.runtime.jit import compute_cache_key

                assert hasattr(self.kernel, "device_caches") and hasattr(self.kernel, "pre_run_hooks")
                self._rt = (knobs, driver, knobs.HookChain, compute_cache_key)
                return self._launch_upstream
            if flavour == "ascend":
                assert all(hasattr(self.kernel, a) for a in ("binder", "cache", "bishengir_option", "pre_run_hooks"))
                self._rt = driver
                return self._launch_ascend
        except Exception as e:  # noqa: BLE001 -- any surprise: the normal path
            self._debug_once("fast Triton launch off for %s: %r", self.kernel, e)
            return self._launch_normal
        self._debug_once("fast Triton launch off for %s: Triton %s on this backend is not one this module knows",
                         self.kernel, triton.__version__)
        return self._launch_normal

    def _launch_normal(self, grid, *args, **kwargs):
        return self.kernel[grid](*args, **kwargs)

    def _key_fn(self, nargs: int):
        fn = self._key_fns.get(nargs, False)
        if fn is False:
            fn = self._key_fns[nargs] = _make_key_fn(self.kernel.params, nargs)
        return fn

    def _globals_changed(self) -> bool:
        """JITFunction.run's check that no global a kernel read at compile time has changed (run raises then)."""
        missing = object()
        for (name, _), (val, globals_dict) in self.kernel.used_global_vals.items():
            if globals_dict.get(name, missing) != val:
                return True
        return False

    def _bind(self, key, kernel, triton_key, cache, binder_args, args, kwargs, only_runtime: bool) -> None:
        """Remember `kernel` for `key` if Triton cached it under its own key for this call and the argument
        list rebuilt from (args, kwargs) is the binder's."""
        if cache.get(triton_key) is not kernel or not isinstance(kernel, self._compiled_kernel):
            self._debug_once("fast Triton launch: %s not bound (Triton did not cache this launch under its key)",
                             self.kernel)
            return
        assemble = _make_assembler(self.kernel.params, len(args), tuple(kwargs), only_runtime)
        if assemble is None or not _same(assemble(args, kwargs), binder_args):
            self._debug_once("fast Triton launch: %s not bound (argument layout)", self.kernel)
            return
        if len(self.bindings) >= _MAX_BINDINGS:
            self.bindings.clear()
        self.bindings[key] = (kernel.run, kernel.function, kernel.packed_metadata, assemble, triton_key)

    def _check(self, bound, triton_key, binder_args, args, kwargs) -> None:
        """GRAPHINFER_TRITON_FAST_LAUNCH=check: the bound key and arguments must be what Triton computes now."""
        if triton_key != bound[4] or not _same(bound[3](args, kwargs), binder_args):
            raise RuntimeError(f"fast Triton launch of {self.kernel}: bound to Triton key {bound[4]!r} but Triton "
                               f"computes {triton_key!r} for this call (or other launcher arguments); "
                               f"run with {ENV}=0 and report this")

    # ----- upstream Triton 3.6 -----
    def _triton_key_upstream(self, device, args, kwargs):
        """(Triton's cache key, the binder's argument values) exactly as JITFunction.run computes them."""
        fn = self.kernel
        knobs, _, _, compute_cache_key = self._rt
        kw = dict(kwargs)
        kw["debug"] = kw.get("debug", fn.debug) or knobs.runtime.debug
        kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
        _, kernel_key_cache, _, _, binder = fn.device_caches[device]
        bound_args, specialization, options = binder(*args, **kw)
        return compute_cache_key(kernel_key_cache, specialization, options), tuple(bound_args.values())

    def _launch_upstream(self, grid, *args, **kwargs):
        fn = self.kernel
        knobs, driver, HookChain, _ = self._rt
        rt = knobs.runtime
        enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
        key_fn = self._key_fns.get(len(args)) or self._key_fn(len(args))
        if (_switch["mode"] == "off" or key_fn is None or type(grid) is not tuple or fn.pre_run_hooks
                or (enter is not None and (type(enter) is not HookChain or enter.calls))
                or (leave is not None and (type(leave) is not HookChain or leave.calls))):
            return fn.run(*args, grid=grid, warmup=False, **kwargs)
        drv = driver.active
        device = drv.get_current_device()
        try:
            key = key_fn(device, fn.debug, rt.debug, knobs.compilation.instrumentation_mode, args, kwargs)
            bound = self.bindings.get(key)
        except TypeError:  # an unhashable argument
            return fn.run(*args, grid=grid, warmup=False, **kwargs)
        if bound is None or (fn.used_global_vals and self._globals_changed()):
            kernel = fn.run(*args, grid=grid, warmup=False, **kwargs)
            try:
                triton_key, binder_args = self._triton_key_upstream(device, args, kwargs)
                self._bind(key, kernel, triton_key, fn.device_caches[device][0], binder_args, args, kwargs, False)
            except Exception as e:  # noqa: BLE001
                self._debug_once("fast Triton launch: binding %s failed: %r", fn, e)
            return kernel
        if _switch["mode"] == "check":
            self._check(bound, *self._triton_key_upstream(device, args, kwargs), args, kwargs)
        launcher, function, packed, assemble, _ = bound
        n = len(grid)
        launcher(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, drv.get_current_stream(device),
                 function, packed, None, None, None, *assemble(args, kwargs))
        return None

    # ----- Triton-Ascend 3.2 -----
    def _triton_key_ascend(self, args, kwargs):
        """(Triton's cache key, the binder's non-constexpr values) exactly as JITFunction.run computes them."""
        fn = self.kernel
        kw = dict(kwargs)
        kw["debug"] = kw.get("debug", False) or os.environ.get("TRITON_DEBUG", "0") == "1"
        if fn.bishengir_option:
            kw.update(fn.bishengir_option)
        _, sig_and_spec, constexpr_vals, non_constexpr_vals, excess_kwargs = fn.binder(*args, **kw)
        return "".join(sig_and_spec) + str((constexpr_vals, excess_kwargs)), tuple(non_constexpr_vals)

    def _launch_ascend(self, grid, *args, **kwargs):
        fn = self.kernel
        compiled = self._compiled_kernel
        key_fn = self._key_fns.get(len(args)) or self._key_fn(len(args))
        if (_switch["mode"] == "off" or key_fn is None or type(grid) is not tuple or fn.pre_run_hooks
                or fn.bishengir_option or compiled.launch_enter_hook is not None
                or compiled.launch_exit_hook is not None):
            return fn.run(*args, grid=grid, warmup=False, **kwargs)
        drv = self._rt.active
        device = drv.get_current_device()
        n = len(grid)
        g0, g1, g2 = grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1
        try:
            key = key_fn(device, os.environ.get("TRITON_DEBUG"), None, None, args, kwargs)
            bound = self.bindings.get(key)
        except TypeError:  # an unhashable argument
            return fn.run(*args, grid=grid, warmup=False, **kwargs)
        if (bound is None or (fn.used_global_vals and self._globals_changed())
                or (g0 * g1 * g2 > 65535 and os.getenv("TRITON_ALL_BLOCKS_PARALLEL", "0") == "0")):  # run raises
            kernel = fn.run(*args, grid=grid, warmup=False, **kwargs)  # (makes fn.binder at the first call)
            try:
                triton_key, binder_args = self._triton_key_ascend(args, kwargs)
                self._bind(key, kernel, triton_key, fn.cache[device], binder_args, args, kwargs, True)
            except Exception as e:  # noqa: BLE001
                self._debug_once("fast Triton launch: binding %s failed: %r", fn, e)
            return kernel
        if _switch["mode"] == "check":
            self._check(bound, *self._triton_key_ascend(args, kwargs), args, kwargs)
        launcher, function, packed, assemble, _ = bound
        stream = kwargs["stream"] if "stream" in kwargs else drv.get_current_stream(device)
        launcher(g0, g1, g2, stream, function, packed, None, None, None, *assemble(args, kwargs))
        return None


_BY_KERNEL: dict[int, Launcher] = {}


def launch_kernel(kernel, grid, *args, **kwargs):
    """`launch_kernel(kernel, grid, *args, **kw)` = `kernel[grid](*args, **kw)` through the kernel's Launcher
    (made at the first call). A module-level `Launcher(kernel)` called as `.launch(grid, ...)` saves the lookup."""
    launcher = _BY_KERNEL.get(id(kernel))
    if launcher is None:
        launcher = _BY_KERNEL[id(kernel)] = Launcher(kernel)  # holds the kernel: its id stays unique
    return launcher.launch(grid, *args, **kwargs)


def _same(a, b) -> bool:
    """Element-wise identity (values the launcher receives are the very objects the binder returned)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))
