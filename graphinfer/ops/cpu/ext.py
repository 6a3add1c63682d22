"""The cpu platform's C++ kernels (csrc/cpu/): built by `make` with the machine's own compiler, loaded if present.

`python -m graphinfer.ops.cpu.ext` compiles them into graphinfer/ops/cpu/_cpu_kernels.so for this machine's CPU
(-march=native) and this torch; a sidecar file records the torch version, and a library built for another
torch is not loaded (rebuild with `make venv` or the command above). Without the library, the cpu ops fall
back to their pure-PyTorch forms (graphinfer/ops/cpu/*.py), which give the same results, slower.
"""
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).resolve().parents[3] / "csrc" / "cpu").glob("*.cpp"))
LIBRARY = Path(__file__).with_name("_cpu_kernels.so")
_TORCH_STAMP = LIBRARY.with_name(LIBRARY.name + ".torch")
_loaded: bool | None = None


def build(compiler: str = "g++") -> Path:
    """Each source compiled to an object in parallel (one process per file), then linked into LIBRARY."""
    from torch.utils import cpp_extension

    if not SOURCES:
        raise FileNotFoundError("csrc/cpu/*.cpp not found: build from a source checkout")
    lib_dir = Path(torch.__file__).parent / "lib"
    flags = [compiler, "-O3", "-march=native", "-fopenmp", "-std=c++20", "-fPIC",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *capability_flags(),
             *(f"-I{p}" for p in cpp_extension.include_paths())]
    with tempfile.TemporaryDirectory() as tmp:
        objects = [os.path.join(tmp, src.stem + ".o") for src in SOURCES]
        jobs = [subprocess.Popen([*flags, "-c", str(src), "-o", obj]) for src, obj in zip(SOURCES, objects)]
        if any([job.wait() for job in jobs]):  # every job waited for, failed or not
            raise RuntimeError(f"compiling csrc/cpu/ with {compiler} failed (its errors are above)")
        subprocess.run([*flags, "-shared", *objects, f"-L{lib_dir}", "-lc10", "-ltorch_cpu", "-ltorch",
                        f"-Wl,-rpath,{lib_dir}", "-o", str(LIBRARY)], check=True)
    _TORCH_STAMP.write_text(torch.__version__)
    return LIBRARY


def capability_flags() -> list[str]:
    """ATen's vector types (csrc/cpu/vec.h) for the ISA torch itself dispatches to on this CPU: AVX512 or AVX2 (the
    instructions -march=native enables), else its scalar fallback."""
    cap = torch.backends.cpu.get_cpu_capability()
    cap = "AVX512" if cap.startswith("AVX512") else "AVX2" if cap.startswith("AVX2") else "DEFAULT"
    return [f"-DCPU_CAPABILITY={cap}"] + ([f"-DCPU_CAPABILITY_{cap}"] if cap != "DEFAULT" else [])


def available() -> bool:
    """Load the library once; False (and one warning saying how to build it) where it is missing or stale."""
    global _loaded
    if _loaded is None:
        _loaded = False
        if not LIBRARY.exists():
            logger.info("cpu C++ kernels not built (%s): using the PyTorch fallbacks; build with "
                        "`python -m graphinfer.ops.cpu.ext`", LIBRARY.name)
        elif not _TORCH_STAMP.exists() or _TORCH_STAMP.read_text() != torch.__version__:
            logger.warning("%s was built for another torch than %s: using the PyTorch fallbacks; rebuild with "
                           "`python -m graphinfer.ops.cpu.ext`", LIBRARY.name, torch.__version__)
        else:
            torch.ops.load_library(str(LIBRARY))
            _loaded = True
    return _loaded


if __name__ == "__main__":
    print(f"built {build(*sys.argv[1:])}")
