"""Engine arguments, made from EngineConfig's fields (as vLLM's EngineArgs / arg_utils, nano-vllm's fields(Config)).

graphinfer/config.py writes each engine setting once: a dataclass field with its default and a short help text
(config.setting). From those fields this module makes
  - the flat keyword arguments of LLM(**kwargs) (create_engine_config: a name that is not one raises
    UnknownEngineArgumentError with the close matches), an artifact's settings filling those not given;
  - the `graphinfer` CLI's flags (add_cli_args): `--max-num-seqs`, `--enable-prefix-caching /
    --no-enable-prefix-caching`, ... (vLLM's names: the field's name with dashes; booleans as
    argparse.BooleanOptionalAction), each flag's default the field's, unless a bench subcommand says otherwise.
A field that is not an engine argument is in NOT_ARGUMENTS with the reason.
"""
import argparse
import dataclasses
import difflib
import functools
import types
import typing

from graphinfer.config import (CacheConfig, CompileConfig, EngineConfig, LoRAConfig, ModelConfig, ParallelConfig,
                               SchedulerConfig)
from graphinfer.errors import InvalidConfigError

SECTIONS = {"model_config": ModelConfig, "cache_config": CacheConfig, "scheduler_config": SchedulerConfig,
            "compile_config": CompileConfig, "parallel_config": ParallelConfig,
            "lora_config": LoRAConfig}

# EngineConfig fields that are neither LLM keyword arguments nor CLI flags, and why.
NOT_ARGUMENTS = {
    "data_parallel_rank": "set by the data-parallel front end for each replica it starts (runtime/engine/dp_core.py)",
}


class UnknownEngineArgumentError(InvalidConfigError, TypeError):
    """LLM(...) got a keyword argument that is no engine setting (a TypeError too, as for any unknown keyword)."""


@dataclasses.dataclass(frozen=True)
class EngineArg:
    name: str
    section: str | None  # the EngineConfig section the field belongs to; None: a field of EngineConfig itself
    field: dataclasses.Field
    annotation: object

    @property
    def default(self):
        return self.field.default

    @property
    def help(self) -> str:
        return self.field.metadata.get("help", "")

    @property
    def flag(self) -> str:
        return self.field.metadata.get("flag") or "--" + self.name.replace("_", "-")


@functools.cache
def engine_args() -> dict[str, EngineArg]:
    """Every engine argument by name, in EngineConfig's order (the sections' fields, then EngineConfig's own)."""
    hints = {cls: typing.get_type_hints(cls) for cls in (*SECTIONS.values(), EngineConfig)}
    out = {}
    for section, cls in [*SECTIONS.items(), (None, EngineConfig)]:
        for f in dataclasses.fields(cls):
            if f.name in SECTIONS or f.name in NOT_ARGUMENTS:
                continue
            assert f.name not in out, f"engine setting {f.name!r} is a field of two sections"
            assert f.default is not dataclasses.MISSING, f"engine setting {f.name!r} has no default"
            out[f.name] = EngineArg(f.name, section, f, hints[cls][f.name])
    return out


def default(name: str):
    """The engine setting's default, as EngineConfig writes it."""
    return engine_args()[name].default


def check_names(names, what: str = "LLM()") -> None:
    known = engine_args()
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3, cutoff=0.6)
            hint = f" Did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            raise UnknownEngineArgumentError(
                f"{what} got an unknown engine argument {name!r}.{hint} The engine arguments are EngineConfig's "
                f"fields (graphinfer/config.py; docs/configuration.md): {', '.join(sorted(known))}.")


def with_artifact_defaults(kwargs: dict) -> dict:
    """kwargs with the settings an artifact was compiled with where they were not given (model, dtype, quantization,
    graph mode, capture sizes, splitting ops, speculative config, tensor / expert parallel, LoRA); the rest as given."""
    art = kwargs.get("artifact")
    if not art:
        return dict(kwargs)
    from graphinfer.compiler import artifact as artifacts

    manifest = artifacts.read_manifest(art)
    given = {k: v for k, v in kwargs.items() if v is not None and v != default(k)}
    derived = {
        "model": manifest["model"]["path"], "dtype": manifest["dtype"],
        "quantization": (manifest.get("quantization") or {}).get("method"),
        # cpu: its decode graphs are traced at start-up, nothing of them is in the artifact: the kernels' default
        "graph_mode": manifest["graph_mode"] if manifest["platform"] != "cpu" else None,
        "capture_sizes": manifest["capture_sizes"],
        "splitting_ops": (manifest.get("split") or {}).get("splitting_ops"),
        "speculative_config": manifest.get("speculative_config"),
        "tensor_parallel_size": artifacts.tensor_parallel_size(manifest),
        "pipeline_parallel_size": artifacts.pipeline_parallel_size(manifest),
        "pp_layer_partition": ",".join(map(str, p)) if (p := manifest.get("pp_layer_partition")) else None,
        "enable_expert_parallel": artifacts.expert_parallel(manifest),
        "enable_lora": manifest.get("enable_lora", False),
    }
    return {**kwargs, **{k: v for k, v in derived.items() if k not in given}}


def create_engine_config(kwargs: dict, **internal) -> EngineConfig:
    """Flat engine arguments (LLM's keyword arguments, the CLI's flags) -> EngineConfig. internal: the fields of
    NOT_ARGUMENTS that graphinfer itself sets."""
    check_names(kwargs)
    assert set(internal) <= set(NOT_ARGUMENTS), internal
    kwargs = with_artifact_defaults(kwargs)
    args = engine_args()
    parts: dict[str | None, dict] = {s: {} for s in [*SECTIONS, None]}
    for name, value in kwargs.items():
        parts[args[name].section][name] = value
    for name, value in internal.items():
        section = next((s for s, cls in SECTIONS.items() if name in {f.name for f in dataclasses.fields(cls)}), None)
        parts[section][name] = value
    return EngineConfig(**{s: cls(**parts[s]) for s, cls in SECTIONS.items()}, **parts[None])


# --- the CLI ---------------------------------------------------------------------------------------------------------

def _csv(cast):
    def parse(text: str) -> list:
        return [cast(v.strip()) for v in text.split(",") if v.strip()]
    parse.__name__ = f"comma-separated {cast.__name__}"
    return parse


def _cli_type(arg: EngineArg):
    """How a flag's text becomes the field's value: the field's `parse`, else from its type (int, float, str, a
    comma-separated list[int] / list[str]); None for a bool (a BooleanOptionalAction)."""
    if "parse" in arg.field.metadata:
        return arg.field.metadata["parse"]
    t = arg.annotation
    options = [a for a in typing.get_args(t) if a is not type(None)] if isinstance(t, types.UnionType) else [t]
    if options == [bool]:
        return None
    for o in options:
        if typing.get_origin(o) is list and options == [o]:
            return _csv(typing.get_args(o)[0])
        if o in (int, float) and len(options) == 1:
            return o
    if str in options:  # "a,b,c" strings too where the field also takes a list (passes) or a torch.dtype (dtype)
        return str
    raise TypeError(f"engine setting {arg.name!r}: no CLI type for {t}; give it parse= in config.py")


def add_cli_args(parser, names=None, *, exclude=(), defaults: dict | None = None, helps: dict | None = None) -> None:
    """Add the engine settings `names` (default: all) less `exclude` to parser (or an argument group) as flags, each
    with its field's default unless `defaults` overrides it (the bench subcommands' workloads), dest = the field name.
    Accepted old spellings (the field's deprecated=[...]) parse to the same dest but stay out of --help."""
    args = engine_args()
    if names is None:
        names = list(args)
    check_names([*names, *exclude], what="add_cli_args")
    defaults, helps = defaults or {}, helps or {}
    for name in names:
        if name in exclude:
            continue
        arg = args[name]
        meta = arg.field.metadata
        value = defaults.get(name, arg.default)
        kw = dict(dest=name, default=value, help=(helps.get(name) or arg.help).replace("%", "%%"))
        parse = _cli_type(arg)
        if parse is None:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = parse
        if "choices" in meta:
            kw["choices"] = list(meta["choices"])
        if "metavar" in meta:
            kw["metavar"] = meta["metavar"]
        parser.add_argument(*meta.get("aliases", ()), arg.flag, **kw)
        for old in meta.get("deprecated", ()):
            if parse is None:  # a boolean's old negative spelling, e.g. --no-prefix-caching
                parser.add_argument(old, dest=name, action="store_false" if old.startswith("--no-") else "store_true",
                                    default=argparse.SUPPRESS, help=argparse.SUPPRESS)
            else:
                parser.add_argument(old, dest=name, type=parse, default=argparse.SUPPRESS, help=argparse.SUPPRESS)


def kwargs_from_args(args: argparse.Namespace, names=None) -> dict:
    """The engine settings parsed from the CLI (those of `names`, default: every one the parser had) as keyword
    arguments for LLM / create_engine_config."""
    names = engine_args() if names is None else names
    return {n: getattr(args, n) for n in names if n in engine_args() and hasattr(args, n)}


# --- docs/configuration.md ----------------------------------------------------------------------------------------

BEGIN, END = "<!-- BEGIN generated by `python -m graphinfer.engine_args` -->", "<!-- END generated -->"


def markdown() -> str:
    """The tables docs/configuration.md carries between BEGIN and END (tests/test_settings.py checks they match)."""
    from graphinfer import envs

    def cell(text) -> str:
        return str(text).replace("|", "\\|")

    lines = ["### Engine settings (`EngineConfig`)", "",
             "| LLM keyword | CLI flag | default | section | meaning |", "|---|---|---|---|---|"]
    for arg in engine_args().values():
        meta = arg.field.metadata
        flags = [f"`{f}`" for f in (*meta.get("aliases", ()), arg.flag)]
        if _cli_type(arg) is None:
            flags.append(f"`--no-{arg.flag[2:]}`")
        flags += [f"`{old}` (deprecated)" for old in meta.get("deprecated", ())]
        lines.append(f"| `{arg.name}` | {', '.join(flags)} | `{arg.default!r}` | "
                     f"{arg.section or 'EngineConfig'} | {cell(arg.help)} |")
    lines += ["", "Not engine arguments (set by graphinfer itself):", ""]
    lines += [f"- `{name}`: {why}." for name, why in NOT_ARGUMENTS.items()]
    lines += ["", "### Environment variables (`graphinfer/envs.py`)", "",
              "| variable | default | engine setting | meaning |", "|---|---|---|---|"]
    for var in envs.VARIABLES.values():
        default_ = f"`{var.default}`" if var.default is not None else "unset"
        setting = f"`{var.setting}`" if var.setting else "-"
        lines.append(f"| `{var.name}` | {default_} | {setting} | {cell(var.meaning)} |")
    return "\n".join([BEGIN, *lines, END])


if __name__ == "__main__":
    print(markdown())
