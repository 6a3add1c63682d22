"""Which passes exist: the built-ins plus plugins from the `graphinfer.passes` entry-point group.

A plugin package declares, e.g. in its pyproject.toml:
    [project.entry-points."graphinfer.passes"]
    my_pass = "my_package.my_module:MyPass"     # a graphinfer.passes.Pass subclass
"""
from collections.abc import Sequence
from dataclasses import dataclass
from importlib.metadata import entry_points

from graphinfer.errors import InvalidConfigError
from graphinfer.passes.base import Pass
from graphinfer.passes.cleanup import CleanupPass
from graphinfer.passes.fuse_add_rmsnorm import FuseAddRMSNormPass
from graphinfer.passes.fuse_gate_up import FuseGateUpPass
from graphinfer.passes.fuse_moe import FuseMoEPass
from graphinfer.passes.fuse_qkv import FuseQKVPass

BUILTIN_PASSES: tuple[type[Pass], ...] = (FuseQKVPass, FuseGateUpPass, FuseAddRMSNormPass, FuseMoEPass, CleanupPass)
DEFAULT_PASSES = ("fuse_qkv", "fuse_gate_up", "fuse_add_rmsnorm", "fuse_moe", "cleanup")


@dataclass
class PassInfo:
    cls: type[Pass]
    origin: str  # "built-in" or "plugin (<distribution>)"


def available_passes() -> dict[str, PassInfo]:
    found = {cls.name: PassInfo(cls, "built-in") for cls in BUILTIN_PASSES}
    for ep in entry_points(group="graphinfer.passes"):
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, Pass)):
            raise InvalidConfigError(f"Entry point {ep.name!r} ({ep.value}) in group graphinfer.passes is not a "
                                     f"graphinfer.passes.Pass subclass; fix the plugin package.")
        dist = ep.dist.name if ep.dist is not None else "unknown package"
        found.setdefault(cls.name or ep.name, PassInfo(cls, f"plugin ({dist})"))
    return found


def resolve_passes(spec: str | Sequence[str] | None) -> list[Pass]:
    """'default' (or None), 'none', 'a,b,c' or a list of names -> fresh Pass instances, in that order."""
    if spec is None or spec == "default":
        names = list(DEFAULT_PASSES)
    elif spec == "none":
        names = []
    else:
        names = [n.strip() for n in spec.split(",") if n.strip()] if isinstance(spec, str) else list(spec)
    available = available_passes()
    unknown = [n for n in names if n not in available]
    if unknown:
        raise InvalidConfigError(f"Unknown pass(es) {unknown}. Available: {', '.join(available)}; "
                                 f"or 'default' / 'none'. See `graphinfer passes list`.")
    return [available[n].cls() for n in names]
