"""Platform selection: GRAPHINFER_PLATFORM, else detection (plugins, cuda, npu, cpu).

Third-party platforms register a Platform subclass in the entry-point group `graphinfer.platforms`:
    [project.entry-points."graphinfer.platforms"]
    my_accel = "my_package.platform:MyAccelPlatform"
"""
import functools
from importlib.metadata import entry_points

from graphinfer import envs
from graphinfer.errors import InvalidConfigError
from graphinfer.platforms.cpu import CpuPlatform
from graphinfer.platforms.cuda import CudaPlatform
from graphinfer.platforms.interface import KernelBackend, Platform
from graphinfer.platforms.npu import NpuPlatform

BUILTIN_PLATFORMS: dict[str, type[Platform]] = {"cuda": CudaPlatform, "npu": NpuPlatform, "cpu": CpuPlatform}


def available_platforms() -> dict[str, type[Platform]]:
    """Plugins first (so detection tries them before the built-ins), then cuda, npu, cpu."""
    found: dict[str, type[Platform]] = {}
    for ep in entry_points(group="graphinfer.platforms"):
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, Platform)):
            raise InvalidConfigError(f"Entry point {ep.name!r} ({ep.value}) in group graphinfer.platforms is not a "
                                     f"graphinfer.platforms.Platform subclass; fix the plugin package.")
        found[cls.name or ep.name] = cls
    return {**found, **BUILTIN_PLATFORMS}


@functools.cache
def get_platform(name: str) -> Platform:
    """The platform called `name` (one instance per name)."""
    platforms = available_platforms()
    if name not in platforms:
        raise InvalidConfigError(f"Unknown platform {name!r}; available: {', '.join(platforms)}.")
    return platforms[name]()


def current_platform() -> Platform:
    """$GRAPHINFER_PLATFORM if set, else the first available of: plugins, cuda, npu, cpu."""
    name = envs.GRAPHINFER_PLATFORM
    if name:
        return get_platform(name)
    return get_platform(next(n for n, cls in available_platforms().items() if cls.is_available()))


def platform_for_device(device_type: str) -> Platform:
    """The platform that owns torch device type `device_type` (e.g. an explicit device="cuda:1")."""
    for name, cls in available_platforms().items():
        if cls.device_type == device_type:
            return get_platform(name)
    raise InvalidConfigError(f"No graphinfer platform runs torch device type {device_type!r}; "
                             f"use one of: {', '.join(c.device_type for c in available_platforms().values())}.")


__all__ = ["KernelBackend", "Platform", "available_platforms", "current_platform", "get_platform",
           "platform_for_device"]
