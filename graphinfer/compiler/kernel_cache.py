"""An artifact's compiled-kernel cache: kernel_cache/ holds one directory per compiler cache, filled by
`graphinfer compile` on the target device and handed to the compilers by environment variable at start-up.

  kernel_cache/kernel_cache.json   who filled it: platform, device name, graphinfer / torch / triton versions
  kernel_cache/triton/             TRITON_CACHE_DIR (Triton's compiled kernels: cubins, metadata)
  kernel_cache/inductor/           TORCHINDUCTOR_CACHE_DIR (TorchInductor's generated code, where a platform uses it)

A platform that compiles nothing (cpu with the reference ops) writes no kernel_cache/. At start-up the cache is
used only where kernel_cache.json matches this machine exactly; otherwise a warning says why and the kernels
are compiled again (into the default caches). Compilers keep adding to the cache at serve time (shapes compile
did not reach), so it is not covered by the manifest's file hashes: the versions guard it, as they guard
~/.triton/cache.
"""
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile

import torch

import graphinfer

logger = logging.getLogger(__name__)

KERNEL_CACHE, INFO = "kernel_cache", "kernel_cache.json"
CACHE_ENV = {"triton": "TRITON_CACHE_DIR", "inductor": "TORCHINDUCTOR_CACHE_DIR"}  # subdirectory -> its variable


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def describe(device: torch.device) -> dict:
    """What compiled kernels depend on: the device model and the compilers' versions."""
    module = getattr(torch, device.type, None)  # torch.cuda / torch.npu (activated by its platform)
    if device.type == "cpu":  # Inductor's C++ is built for this vector ISA
        name = f"cpu ({torch.backends.cpu.get_cpu_capability()})"
    else:
        name = module.get_device_name(device) if hasattr(module, "get_device_name") else device.type
    return {"platform": device.type, "device_name": name, "graphinfer_version": graphinfer.__version__,
            "torch_version": torch.__version__, "triton_version": _version("triton") or _version("triton-ascend")}


def _point_at(root: str) -> None:
    for sub, var in CACHE_ENV.items():
        os.makedirs(os.path.join(root, sub), exist_ok=True)
        os.environ[var] = os.path.join(root, sub)


def collect(art_dir: str, device: torch.device) -> str:
    """Before `compile` builds and warms the engine: start an empty kernel_cache/ in the artifact and point the
    compilers at it, so every kernel compiled from here on lands there. Returns its path."""
    root = os.path.join(art_dir, KERNEL_CACHE)
    shutil.rmtree(root, ignore_errors=True)
    _point_at(root)
    with open(os.path.join(root, INFO), "w") as f:
        json.dump(describe(device), f, indent=2)
    return root


def clear(art_dir: str) -> None:
    """Remove an artifact's kernel cache (a compile for a platform that has none)."""
    shutil.rmtree(os.path.join(art_dir, KERNEL_CACHE), ignore_errors=True)


def use(art_dir: str, device: torch.device) -> bool:
    """At start-up from an artifact, before any kernel compiles: point the compilers at its kernel cache if it
    was made on this kind of device with these versions (True); else warn and leave the default caches."""
    root = os.path.join(art_dir, KERNEL_CACHE)
    info_path = os.path.join(root, INFO)
    if not os.path.isfile(info_path):
        return False
    with open(info_path) as f:
        recorded = json.load(f)
    here = describe(device)
    diffs = [f"{k}: {recorded.get(k)!r} there, {v!r} here" for k, v in here.items() if recorded.get(k) != v]
    if diffs:
        logger.warning("artifact %s: its compiled kernels were made for another device or versions (%s); "
                       "compiling them again. Re-run `graphinfer compile` on this machine to keep them.",
                       art_dir, "; ".join(diffs))
        return False
    if not os.access(root, os.W_OK):  # compilers write new entries (and lock files): use a writable copy
        copy = os.path.join(tempfile.mkdtemp(prefix="graphinfer-kernels-"), KERNEL_CACHE)
        shutil.copytree(root, copy)
        root = copy
    _point_at(root)
    return True
