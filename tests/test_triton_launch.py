"""graphinfer.ops.triton.launch: the fast Triton launch path, checked on CPU against Triton's own launch path.

No GPU here, so the device side is a stand-in (graphinfer.ops.triton.launch_stub): Triton's real JITFunction.run
and the Launcher both run their host code against a stub driver, and "compiling" makes a no-op kernel that
Triton caches under its own key. What is checked: the Launcher launches the compiled kernel Triton's run would
launch, with the same arguments, for calls that differ in every way Triton specialises on (pointer alignment
and dtype, ints equal to 1 / divisible by 16 / 64-bit, constexprs, num_warps); the rules its key relies on
agree with Triton's own per-argument specialisation; the fallbacks (interpreter, unknown version, hooks,
GRAPHINFER_TRITON_FAST_LAUNCH=0) and the check mode; and, in a whole eager forward, that every launch after
warm-up is served without JITFunction.run. Runs under upstream Triton 3.6 (.venv) and Triton-Ascend 3.2
(.venv-ascend: `PYTHONPATH=. .venv-ascend/bin/python -m pytest tests/test_triton_launch.py`).
What this cannot check: the real compiled launchers (CUDA/NPU), i.e. that a device launch behaves as in `run`.
"""
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # as test_triton_kernels: the op wrappers' kernels interpreted

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

try:  # native_specialize_impl imports gluon on first use, which asserts its tl functions match TRITON_INTERPRET:
    import triton.experimental.gluon  # noqa: E402,F401  import it now, while the variable is as at tl's import
except ImportError:  # Triton-Ascend 3.2 has no gluon
    pass

from graphinfer.ops.triton import launch  # noqa: E402
from graphinfer.ops.triton.launch import Launcher, set_fast_launch  # noqa: E402

# The CPU stand-in replaces a device's runtime: where CUDA is present, conftest deselects this file's tests and the test
# below runs the whole file in a subprocess with CUDA hidden (there it is not defined: no CUDA).
CPU_SUBPROCESS_ONLY = True

if torch.cuda.is_available():
    def test_this_file_on_cpu_in_a_subprocess():
        from cpu_env import cpu_subprocess_env

        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                             env=cpu_subprocess_env(), cwd=os.path.dirname(os.path.dirname(__file__)),
                             capture_output=True, text=True, timeout=900)
        assert out.returncode == 0 and " passed" in out.stdout.splitlines()[-1], out.stdout[-6000:] + out.stderr[-2000:]

ASCEND = launch._version() in launch._ASCEND and os.path.isdir(os.path.join(os.path.dirname(triton.__file__),
                                                                              "backends", "ascend"))


def _probe(x_ptr, y_ptr, n, m, scale, FLAG: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if FLAG:
        x = x * scale
    tl.store(y_ptr + offs, x, mask=offs < m)


def _one(x):  # one runtime parameter: for the per-argument key rules
    pass


@pytest.fixture
def stub(monkeypatch):
    """A fresh real JITFunction of _probe and its Launcher, inside the stub runtime (fast launch on)."""
    from graphinfer.ops.triton.launch_stub import stub_triton_runtime

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the probe is compiled (stubbed), not interpreted
    previous = set_fast_launch("on")
    fn = JITFunction(_probe)
    launcher = Launcher(fn)
    with stub_triton_runtime(record=True) as rt:
        yield fn, launcher, rt
    set_fast_launch(previous)


def _variants():
    """(name, grid, args, kwargs, same specialisation as 'base'?) for the probe."""
    buf = torch.zeros(128)
    half = torch.zeros(128, dtype=torch.float16)
    x, y = buf[:64], torch.zeros(64)
    x2, y2 = torch.zeros(64), torch.zeros(64)  # other tensors, also 16-byte aligned
    kw = dict(FLAG=True, BLOCK=64)
    return [
        ("base", (1,), (x, y, 64, 64, 0.5), dict(kw), True),
        ("other tensors, other float", (1,), (x2, y2, 64, 64, 2.0), dict(kw), True),
        ("grid (2,1)", (2, 1), (x, y, 64, 64, 0.5), dict(kw), True),
        ("n=32 (also %16)", (1,), (x, y, 32, 64, 0.5), dict(kw), True),
        ("misaligned x", (1,), (buf[1:65], y, 64, 64, 0.5), dict(kw), False),
        ("x 8 bytes off", (1,), (buf[2:66], y, 64, 64, 0.5), dict(kw), False),
        ("n=1", (1,), (x, y, 1, 64, 0.5), dict(kw), False),
        ("n=17", (1,), (x, y, 17, 64, 0.5), dict(kw), False),
        ("n=2**40 (i64)", (1,), (x, y, 2 ** 40, 64, 0.5), dict(kw), False),
        ("fp16 x", (1,), (half[:64], y, 64, 64, 0.5), dict(kw), False),
        ("FLAG=False", (1,), (x, y, 64, 64, 0.5), dict(kw, FLAG=False), False),
        ("BLOCK=32", (1,), (x, y, 64, 64, 0.5), dict(kw, BLOCK=32), False),
        ("num_warps=8", (1,), (x, y, 64, 64, 0.5), dict(kw, num_warps=8), False),
    ]


def _launched(call):
    """(grid, stream, kernel handle, packed metadata, kernel arguments) of a recorded launcher call."""
    _, args = call
    return args[:3], args[3], args[4], args[5], args[9:]


def test_fast_launch_launches_what_triton_run_launches(stub):
    fn, launcher, rt = stub
    variants = _variants()
    for _, grid, args, kw, _ in variants:  # Triton's own path: compiles each specialisation once
        fn[grid](*args, **kw)
    normal = [_launched(c) for c in rt.calls]
    compiled = rt.compiles
    base_handle = normal[0][2]
    for (name, *_, same), launched in zip(variants, normal):  # the variants do what they say (Triton's view)
        assert (launched[2] == base_handle) == same, name

    for rounds in range(2):  # first round binds (each new key launches once through run), second only hits
        rt.calls.clear()
        runs = rt.jit_runs
        for _, grid, args, kw, _ in variants:
            launcher(grid, *args, **kw)
        assert rt.compiles == compiled  # no key Triton had not seen: same specialisations
        # "other tensors, other float" and "grid (2,1)" have base's key; every other variant is bound anew
        assert rt.jit_runs - runs == (len(variants) - 2 if rounds == 0 else 0)
        for (name, *_), want, got in zip(variants, normal, (_launched(c) for c in rt.calls)):
            assert got[:4] == want[:4], name  # grid, stream, compiled kernel, packed metadata
            assert len(got[4]) == len(want[4]) and all(a is b for a, b in zip(got[4], want[4])), name
    assert len(launcher.bindings) == len(variants) - 2


def test_key_rules_match_triton_specialisation():
    """Equal keys -> equal specialisation by Triton's own per-argument code (3.6: native_specialize_impl;
    Triton-Ascend 3.2: mangle_type + the backend's compute_spec_key), over tensors of every alignment, dtype,
    shape, stride and wrapper, and floats of any value."""
    from triton.compiler.compiler import make_backend

    if ASCEND:
        from triton.runtime.jit import mangle_type

        backend = make_backend(GPUTarget("npu", "Ascend910B3", 0))

        def spec(a):
            return mangle_type(a, False), backend.compute_spec_key(a, align=True)
    else:
        from triton._C.libtriton import native_specialize_impl

        backend = make_backend(GPUTarget("cuda", 90, 32))

        def spec(a):
            return native_specialize_impl(backend, a, False, True, True)

    key_fn = launch._make_key_fn(JITFunction(_one).params, 1)

    def key(a):
        return key_fn(0, None, None, None, (a,), {})

    storage = torch.zeros(4096, dtype=torch.uint8)
    samples = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32, torch.int64):
        base = storage.view(dtype)
        for offset in range(0, 9):
            samples += [base[offset:], base[offset:offset + 16].view(4, 4), base[offset::2]]
    samples += [torch.nn.Parameter(torch.zeros(8)), torch.zeros(8, requires_grad=True), torch.zeros(3, 5).t()]
    samples += [0.5, -0.0, 1e30, 1.0, 3.0]
    for a in samples:
        for b in samples:
            if key(a) == key(b):
                assert spec(a) == spec(b), (a, b)
    # ...and the key does tell apart what Triton tells apart
    assert len({key(a) for a in samples}) >= len({spec(a) for a in samples})


def test_switch_off_and_env(stub, monkeypatch):
    fn, launcher, rt = stub
    _, grid, args, kw, _ = _variants()[0]
    set_fast_launch("off")
    runs = rt.jit_runs
    for _ in range(3):
        launcher(grid, *args, **kw)
    assert rt.jit_runs - runs == 3 and rt.launches == 3
    for value, mode in (("0", "off"), ("false", "off"), ("1", "on"), ("check", "check"), (None, "on")):
        if value is None:
            monkeypatch.delenv(launch.ENV, raising=False)
        else:
            monkeypatch.setenv(launch.ENV, value)
        set_fast_launch(None)
        assert launch.fast_launch_mode() == mode
    with pytest.raises(ValueError):
        set_fast_launch("fast")


def test_check_mode_compares_with_triton(stub):
    fn, launcher, rt = stub
    _, grid, args, kw, _ = _variants()[0]
    set_fast_launch("check")
    for _ in range(3):
        launcher(grid, *args, **kw)
    assert rt.jit_runs == 1 and rt.launches == 3  # bound after the first; checked, not re-run
    (key, bound), = launcher.bindings.items()
    launcher.bindings[key] = bound[:4] + ("not Triton's key",)
    with pytest.raises(RuntimeError, match="fast Triton launch"):
        launcher(grid, *args, **kw)


def test_unknown_triton_version_uses_run(stub, monkeypatch):
    fn, launcher, rt = stub
    monkeypatch.setattr(launch, "_UPSTREAM", set())
    monkeypatch.setattr(launch, "_ASCEND", set())
    launcher.reset()
    _, grid, args, kw, _ = _variants()[0]
    for _ in range(3):
        launcher(grid, *args, **kw)
    assert rt.jit_runs == 3 and launcher.launch.__name__ == "_launch_normal"


def test_launch_hooks_use_run(stub):
    fn, launcher, rt = stub
    _, grid, args, kw, _ = _variants()[0]
    launcher(grid, *args, **kw)
    seen = []
    if ASCEND:
        from triton.compiler.compiler import CompiledKernel

        CompiledKernel.launch_enter_hook = seen.append
        try:
            launcher(grid, *args, **kw)
        finally:
            CompiledKernel.launch_enter_hook = None
    else:
        from triton import knobs

        knobs.runtime.launch_enter_hook.add(seen.append)
        try:
            launcher(grid, *args, **kw)
        finally:
            knobs.runtime.launch_enter_hook.remove(seen.append)
    assert rt.jit_runs == 2  # the hooked launch went through run (which hands the hooks to the launcher)
    launcher(grid, *args, **kw)
    assert rt.jit_runs == 2


def test_interpreter_uses_normal_launch():
    from graphinfer.ops.triton import TRITON_OPS, norm

    if isinstance(norm._rms_norm_kernel, JITFunction):
        pytest.skip("kernels were decorated without TRITON_INTERPRET=1 in this process")
    x, w = torch.randn(5, 32), torch.ones(32)
    out = TRITON_OPS["rms_norm"](x, w, 1e-6)
    torch.testing.assert_close(out, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert norm._RMS_NORM.launch.__name__ == "_launch_normal"
    launcher = Launcher(JITFunction(_probe))  # even a compiled kernel: TRITON_INTERPRET=1 means no device path
    assert launcher._choose().__name__ == "_launch_normal"


@pytest.mark.parametrize("layout", ["qkv heads", "contiguous heads", "strided rows", "4-d"])
def test_rms_norm_row_layouts(layout):
    """rms_norm reads [T, H, D] views of a fused qkv output in place (no copy) and still equals the reference;
    the other layouts take the flattened-rows path. Under the interpreter here (compiled on a GPU elsewhere)."""
    import graphinfer.ops as ref_ops
    from graphinfer.ops.triton import TRITON_OPS
    from graphinfer.ops.triton.norm import _row_layout

    g = torch.Generator().manual_seed(11)
    T, Hq, Hk, D = 5, 4, 2, 32
    qkv = torch.randn(T, (Hq + 2 * Hk) * D, generator=g)
    x = {"qkv heads": qkv[:, :Hq * D].view(T, Hq, D), "contiguous heads": torch.randn(T, Hq, D, generator=g),
         "strided rows": qkv[:, Hq * D:(Hq + Hk) * D], "4-d": torch.randn(2, T, Hq, D, generator=g)}[layout]
    w = 1 + 0.1 * torch.randn(x.shape[-1], generator=g)
    if layout != "4-d":
        assert _row_layout(x)[0] is x  # no copy
    out = TRITON_OPS["rms_norm"](x, w, 1e-6)
    assert out.is_contiguous() and out.shape == x.shape
    torch.testing.assert_close(out, ref_ops.rms_norm(x, w, 1e-6), atol=2e-5, rtol=2e-5)


FORWARD = """
import os, sys, tempfile, torch
from graphinfer import LLM, SamplingParams
from graphinfer.ops.triton import TRITON_OPS
from graphinfer.ops.triton.launch import all_launchers, set_fast_launch
from graphinfer.ops.triton.launch_stub import stub_triton_runtime

for model in {models!r}:
    llm = LLM(model, max_num_seqs=8, device="cpu", dtype="float32", graph_mode="NONE", num_gpu_blocks_override=64)
    engine = llm.llm_engine
    for i in range(8):
        engine.add_request(str(i), list(range(1, 5 + i)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        engine.step()
    seen = []
    graph = engine.worker.model_runner.graph
    engine.worker.model_runner.graph = lambda *a: seen.append(a) or graph(*a)
    engine.step()
    inputs = seen[-1]
    lib = torch.library.Library("graphinfer", "IMPL", "CPU")
    for name, fn in TRITON_OPS.items():
        lib.impl(name, fn)
    result = {{}}
    with stub_triton_runtime(record=True) as rt, torch.inference_mode():  # one Triton cache for both paths
        for mode in ("off", "on"):
            set_fast_launch(mode)
            graph(*inputs)  # warm-up: compiles (stubbed) and binds
            rt.calls.clear(); rt.jit_runs_by_kernel.clear()
            graph(*inputs)
            routed = {{lc.kernel.fn.__name__ for lc in all_launchers() if lc.bindings}}
            result[mode] = ([(name, a[:6]) for name, a in rt.calls], dict(rt.jit_runs_by_kernel), routed)
    lib._destroy()
    (off, off_runs, _), (on, on_runs, routed) = result["off"], result["on"]
    assert on == off, "fast and normal launches differ"
    assert all(on_runs.get(k, 0) == 0 for k in routed), on_runs
    print(model, len(on), "launches", sum(off_runs.values()), "normal-path runs", sum(on_runs.values()),
          "fast-path runs", sorted(routed), sorted(on_runs))
"""


def test_eager_forward_launches_without_jit_run_after_warmup():
    """A whole eager decode forward (tiny Qwen3 and Qwen3-MoE) with the Triton op wrappers: after one warm-up
    forward, no kernel that has a Launcher goes through JITFunction.run, and the launches (kernel, grid, stream,
    compiled kernel, packed metadata) are exactly those of the normal path."""
    pytest.importorskip("transformers")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", launch.ENV)}
    script = FORWARD.format(models=["tiny-qwen3", "tiny-qwen3-moe"])
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == ["tiny-qwen3", "tiny-qwen3-moe"], out.stdout
    for line in lines:
        assert int(line.split()[1]) > 0
