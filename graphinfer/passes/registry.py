"""Which passes exist: the built-ins plus plugins from the `graphinfer.passes` entry-point group.

A plugin package declares, e.g. in its pyproject.toml:
    [project.entry-points."graphinfer.passes"]
    my_pass = "my_package.my_module:MyPass"     # a graphinfer.passes.Pass subclass; the entry point's name is the pass's

Plugins load lazily: a plugin's module is imported only when its pass is asked for by name (a name that is not
built in) or when every pass is listed (`graphinfer passes list`). Reading the installed entry points (package
metadata, no import) is cheap, so a request for built-in names checks that no plugin claims one of them.
A plugin that fails to import, or does not name a Pass subclass, is reported with a warning where everything
is listed, and is an error only for a request of its own pass.
"""
import importlib.metadata as md
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from graphinfer.errors import InvalidConfigError
from graphinfer.passes.absorb_mla import AbsorbMLAPass
from graphinfer.passes.base import Pass
from graphinfer.passes.cleanup import CleanupPass
from graphinfer.passes.fuse_add_rmsnorm import FuseAddRMSNormPass
from graphinfer.passes.fuse_allreduce_add_rmsnorm import FuseAllReduceAddRMSNormPass
from graphinfer.passes.fuse_gate_up import FuseGateUpPass
from graphinfer.passes.fuse_moe import FuseMoEPass
from graphinfer.passes.canon_rms_norm import CanonRMSNormPass
from graphinfer.passes.canon_rotary import CanonRotaryPass
from graphinfer.passes.canon_transpose import CanonTransposePass
from graphinfer.passes.fuse_qknorm_rope import FuseQKNormRopePass
from graphinfer.passes.fuse_qkv import FuseQKVPass
from graphinfer.passes.fuse_rmsnorm_quant import FuseRMSNormQuantPass
from graphinfer.passes.fuse_silu_mul_quant import FuseSiluMulQuantPass
from graphinfer.passes.lora import LoRAPass
from graphinfer.passes.lower_quant_linears import LowerQuantLinearsPass

GROUP = "graphinfer.passes"
BUILTIN_PASSES: tuple[type[Pass], ...] = (CanonRMSNormPass, CanonRotaryPass, CanonTransposePass, FuseQKVPass, FuseQKNormRopePass, FuseGateUpPass, FuseAddRMSNormPass,
                                          FuseAllReduceAddRMSNormPass, FuseMoEPass, AbsorbMLAPass, LoRAPass, LowerQuantLinearsPass,
                                          FuseRMSNormQuantPass, FuseSiluMulQuantPass, CleanupPass)
# fuse_qknorm_rope matches only where q and k are RMSNormed per head (Qwen3), fuse_allreduce_add_rmsnorm only at
# tp > 1, absorb_mla only in an MLA model (DeepSeek), the quantization passes only in a quantized model; elsewhere
# they find no candidate.
# The canonicalisation passes (canon_*) bring transformers' spellings (model_impl="transformers") to graphinfer's ops
# first; on a native model's graph they find nothing.
# lora is not a default: the pipeline adds it, configured, with enable_lora (compiler/pipeline.py configured_passes).
DEFAULT_PASSES = ("canon_rms_norm", "canon_rotary", "canon_transpose", "fuse_qkv", "fuse_qknorm_rope", "fuse_gate_up", "fuse_add_rmsnorm", "fuse_allreduce_add_rmsnorm",
                  "fuse_moe", "absorb_mla", "lower_quant_linears", "fuse_rmsnorm_quant", "fuse_silu_mul_quant", "cleanup")


class PluginWarning(UserWarning):
    """A pass plugin is installed but cannot be used (it fails to import, or is not a Pass)."""


@dataclass
class PassInfo:
    cls: type[Pass] | None  # None: a plugin that could not be loaded (see error)
    origin: str  # "built-in" or "plugin (<distribution> <version>)"
    distribution: str | None = None
    version: str | None = None
    entry_point: str | None = None  # "module:attr"
    error: str | None = None


def _builtins() -> dict[str, type[Pass]]:
    return {cls.name: cls for cls in BUILTIN_PASSES}


def _entry_points(name: str | None = None) -> list[md.EntryPoint]:
    """Installed `graphinfer.passes` entry points (metadata only: nothing is imported)."""
    eps = md.entry_points(group=GROUP)
    return [ep for ep in eps if name is None or ep.name == name]


def _dist(ep: md.EntryPoint) -> tuple[str, str]:
    dist = getattr(ep, "dist", None)
    return (dist.name, dist.version) if dist is not None else ("an unknown distribution", "?")


def _describe_ep(ep: md.EntryPoint) -> str:
    dist, version = _dist(ep)
    return f"plugin {ep.name!r} = {ep.value} from distribution {dist} {version}"


def _load(ep: md.EntryPoint) -> PassInfo:
    """Import one plugin; never raises: a failure is recorded in PassInfo.error."""
    dist, version = _dist(ep)
    info = PassInfo(None, f"plugin ({dist} {version})", dist, version, ep.value)
    builtins = _builtins()
    if ep.name in builtins:
        info.error = _shadow_message(ep, builtins[ep.name])
        return info
    try:
        obj = ep.load()
    except Exception as e:  # anything at import: a missing dependency, a syntax error, an exception
        info.error = f"importing {ep.value} failed: {type(e).__name__}: {e}"
        return info
    if not (isinstance(obj, type) and issubclass(obj, Pass)):
        info.error = f"{ep.value} is {obj!r}, not a graphinfer.passes.Pass subclass"
    elif obj.name and obj.name != ep.name:
        info.error = (f"{ep.value} says its name is {obj.name!r} but its entry point is named {ep.name!r}; "
                      f"make them the same")
    elif obj.name in builtins or (not obj.name and ep.name in builtins):
        info.error = _shadow_message(ep, builtins[obj.name or ep.name])
    else:
        info.cls = obj
    return info


def _shadow_message(ep: md.EntryPoint, builtin: type[Pass]) -> str:
    return (f"{_describe_ep(ep)} has the name of the built-in pass {builtin.name!r} "
            f"({builtin.__module__}:{builtin.__qualname__}); a name means one pass: rename the plugin's entry point")


def available_passes(include_broken: bool = False) -> dict[str, PassInfo]:
    """Every pass: the built-ins, then every installed plugin (imported now). A plugin that cannot be used is
    left out with a PluginWarning naming its distribution and the error (kept, with .error and no .cls, under
    '<name> (broken)' when include_broken)."""
    found = {name: PassInfo(cls, "built-in") for name, cls in _builtins().items()}
    for ep in _entry_points():
        info = _load(ep)
        if info.error:
            warnings.warn(f"graphinfer pass {_describe_ep(ep)} cannot be used: {info.error}", PluginWarning, stacklevel=2)
            if include_broken:
                found[f"{ep.name} (broken)"] = info
        elif ep.name in found:
            other = found[ep.name]
            info.error = f"two distributions define it: {other.distribution} {other.version} and {info.distribution} {info.version}"
            warnings.warn(f"graphinfer pass {ep.name!r}: {info.error}; uninstall one", PluginWarning, stacklevel=2)
        else:
            found[ep.name] = info
    return found


def _pass_class(name: str, eps: list[md.EntryPoint]) -> type[Pass] | None:
    """The class for one pass name (None: unknown): a built-in, after checking that no plugin claims the name
    too, or a plugin, importing only that plugin. eps: the installed entry points."""
    eps = [ep for ep in eps if ep.name == name]
    builtins = _builtins()
    if name in builtins:
        if eps:
            raise InvalidConfigError(_shadow_message(eps[0], builtins[name]) + ".")
        return builtins[name]
    if not eps:
        return None
    if len({_dist(ep) for ep in eps}) > 1:
        raise InvalidConfigError(f"Pass {name!r} is defined by several plugins: "
                                 f"{'; '.join(_describe_ep(ep) for ep in eps)}. Uninstall all but one.")
    info = _load(eps[0])
    if info.error:
        raise InvalidConfigError(f"Pass {name!r} ({_describe_ep(eps[0])}) cannot be used: {info.error}. "
                                 f"Fix or reinstall {info.distribution}.")
    return info.cls


def resolve_passes(spec) -> list[Pass]:
    """Pass instances, in order, from:
    - None or 'default': the default pipeline; 'none': no passes;
    - 'a,b,c': names run in that order, where 'default' stands for the default pipeline ('default,my_pass') and
      '-name' leaves a pass out ('default,-absorb_mla');
    - a list mixing names, Pass instances and Pass subclasses (instantiated here): ['default', MyPass()].
    Built-in names never import a plugin; a plugin's module is imported when its name is asked for."""
    if spec is None:
        spec = "default"
    if isinstance(spec, (Pass, type)):
        spec = [spec]
    items = [n.strip() for n in spec.split(",") if n.strip()] if isinstance(spec, str) else list(spec)
    if items == ["none"]:
        return []
    eps = _entry_points() if any(isinstance(i, str) for i in items) else []
    out: list[Pass] = []
    unknown: list[str] = []
    left_out = {i[1:] for i in items if isinstance(i, str) and i.startswith("-")}
    items = [i for i in items if not (isinstance(i, str) and i.startswith("-"))]
    if unknown_out := sorted(n for n in left_out if _pass_class(n, eps) is None):
        unknown += [f"-{n}" for n in unknown_out]
    for item in items:
        if isinstance(item, Pass):
            out.append(item)
        elif isinstance(item, type) and issubclass(item, Pass):
            out.append(item())
        elif item == "default":
            out += [_pass_class(n, eps)() for n in DEFAULT_PASSES]
        elif isinstance(item, str):
            cls = _pass_class(item, eps)
            if cls is None:
                unknown.append(item)
            else:
                out.append(cls())
        else:
            raise InvalidConfigError(f"passes: {item!r} is neither a pass name nor a graphinfer.passes.Pass; "
                                     f"use names, 'default', 'none', Pass instances or Pass subclasses.")
    if unknown:
        plugins = sorted({ep.name for ep in eps})
        raise InvalidConfigError(f"Unknown pass(es) {unknown}. Available: {', '.join([*_builtins(), *plugins])}; "
                                 f"or 'default' / 'none'. See `graphinfer passes list`.")
    return [p for p in out if p.name not in left_out]


def pass_origin(p: Pass) -> dict | None:
    """Where a pass that is not built in comes from, for an artifact to import it before loading a graph it
    rewrote: {pass, module, class, distribution, version} (distribution None: an importable module that no
    installed distribution provides). None for built-ins."""
    cls = type(p)
    if cls in BUILTIN_PASSES:
        return None
    module, qualname = cls.__module__, cls.__qualname__
    dist = version = None
    for ep in _entry_points():
        if ep.value.replace(" ", "") == f"{module}:{qualname}" or ep.value.split(":")[0].strip() == module:
            dist, version = _dist(ep)
            break
    else:
        names = md.packages_distributions().get(module.split(".")[0], [])
        if names:
            dist, version = names[0], md.version(names[0])
    return {"pass": p.name or cls.__name__, "module": module, "class": qualname, "distribution": dist,
            "version": version}
