"""The cpu platform's C++ kernels (csrc/cpu/): built by `make` with the machine's own compiler, loaded if present.

`python -m graphinfer.ops.cpu.ext` compiles them into graphinfer/ops/cpu/_cpu_kernels.so for this machine's CPU
(-march=native) and this torch; a sidecar stamp records the torch version and a hash of the csrc/cpu/ sources, and a
library built for another torch or from other sources is stale: not loaded (rebuild with `make venv` or the command
above). `--build scalar` compiles the same sources for any x86-64 (no AVX: ATen's scalar vector types) into
_cpu_kernels_scalar.so, which GRAPHINFER_CPU_KERNELS_BUILD=scalar loads instead; `make venv` builds both, and the
suite runs the kernels' tests on the scalar one too (tests/test_cpu_scalar_build.py). Without the library the cpu ops
fall back to their pure-PyTorch forms (graphinfer/ops/cpu/*.py), which give the same results, slower; the cpu
platform says so when it activates (platforms/cpu.py).
"""
import argparse
import functools
import hashlib
import json
import os
import subprocess
import tempfile
from pathlib import Path

import torch

from graphinfer import envs

SOURCE_DIR = Path(__file__).resolve().parents[3] / "csrc" / "cpu"
SOURCES = sorted(SOURCE_DIR.glob("*.cpp"))
BUILDS = ("native", "scalar")


def library_path(kind: str) -> Path:
    if kind not in BUILDS:
        raise ValueError(f"GRAPHINFER_CPU_KERNELS_BUILD={kind!r}: choose one of {', '.join(BUILDS)}")
    return Path(__file__).with_name("_cpu_kernels.so" if kind == "native" else f"_cpu_kernels_{kind}.so")


BUILD = envs.GRAPHINFER_CPU_KERNELS_BUILD  # which library this process loads, read once
LIBRARY = library_path(BUILD)
STAMP = LIBRARY.with_name(LIBRARY.name + ".stamp")  # JSON: {"torch": version, "sources": source_hash()}


def build(compiler: str = "g++", kind: str | None = None) -> Path:
    """Each source compiled to an object in parallel (one process per file), then linked into the library of `kind`
    (default: the one this process loads, LIBRARY)."""
    from torch.utils import cpp_extension

    if not SOURCES:
        raise FileNotFoundError("csrc/cpu/*.cpp not found: build from a source checkout")
    kind = kind or BUILD
    library = LIBRARY if kind == BUILD else library_path(kind)
    stamp_path = library.with_name(library.name + ".stamp")
    stamp = {"torch": torch.__version__, "sources": source_hash()}  # the sources as compiled, not as left after
    stamp_path.unlink(missing_ok=True)  # a build that fails leaves no stamp: its library is not loaded
    lib_dir = Path(torch.__file__).parent / "lib"
    isa = ["-march=native", *capability_flags()] if kind == "native" else ["-march=x86-64", "-DCPU_CAPABILITY=DEFAULT"]
    flags = [compiler, "-O3", *isa, "-fopenmp", "-std=c++20", "-fPIC",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-I{p}" for p in cpp_extension.include_paths())]
    with tempfile.TemporaryDirectory() as tmp:
        objects = [os.path.join(tmp, src.stem + ".o") for src in SOURCES]
        jobs = [subprocess.Popen([*flags, "-c", str(src), "-o", obj]) for src, obj in zip(SOURCES, objects)]
        if any([job.wait() for job in jobs]):  # every job waited for, failed or not
            raise RuntimeError(f"compiling csrc/cpu/ with {compiler} failed (its errors are above)")
        subprocess.run([*flags, "-shared", *objects, f"-L{lib_dir}", "-lc10", "-ltorch_cpu", "-ltorch",
                        f"-Wl,-rpath,{lib_dir}", "-o", str(library)], check=True)
    stamp_path.write_text(json.dumps(stamp))
    return library


def capability_flags() -> list[str]:
    """ATen's vector types (csrc/cpu/vec.h) for the ISA torch itself dispatches to on this CPU: AVX512 or AVX2 (the
    instructions -march=native enables), else its scalar fallback."""
    cap = torch.backends.cpu.get_cpu_capability()
    cap = "AVX512" if cap.startswith("AVX512") else "AVX2" if cap.startswith("AVX2") else "DEFAULT"
    return [f"-DCPU_CAPABILITY={cap}"] + ([f"-DCPU_CAPABILITY_{cap}"] if cap != "DEFAULT" else [])


def source_hash() -> str | None:
    """sha256 over csrc/cpu/*.cpp and *.h (names and contents; what the Makefile rebuilds on); None without a source
    checkout."""
    files = sorted(f for f in SOURCE_DIR.glob("*") if f.suffix in (".cpp", ".h")) if SOURCE_DIR.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def stale_reason() -> str | None:
    """Why the built library does not match this torch and these sources (None: it matches)."""
    try:
        stamp = json.loads(STAMP.read_text())
    except (OSError, ValueError):
        return f"stale (no readable build stamp {STAMP.name})"
    if stamp.get("torch") != torch.__version__:
        return f"stale (built for torch {stamp.get('torch')}, this is {torch.__version__})"
    sources = source_hash()
    if sources is not None and stamp.get("sources") != sources:  # no csrc/ here: nothing to compare against
        return "stale (built from other csrc/cpu/ sources than these)"
    return None


@functools.cache
def problem() -> str | None:
    """Load the library once. None where it loaded, else why not: "not built", "stale (...)", "failed to load (...)"."""
    if not LIBRARY.exists():
        return "not built"
    reason = stale_reason()
    if reason is not None:
        return reason
    try:
        torch.ops.load_library(str(LIBRARY))
    except (OSError, RuntimeError) as e:  # e.g. undefined symbols of another torch build
        return f"failed to load ({e})"
    return None


def available() -> bool:
    """Whether the library is loaded (loading it on first call). Silent: the cpu platform's activation reports why
    not, where its kernels would use it."""
    return problem() is None


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Build csrc/cpu/ into the library graphinfer's cpu kernels load.")
    parser.add_argument("--build", choices=BUILDS, default="native",
                        help="native: this CPU's instructions (-march=native); scalar: any x86-64")
    parser.add_argument("compiler", nargs="?", default="g++")
    args = parser.parse_args()
    print(f"built {build(args.compiler, args.build)}")
