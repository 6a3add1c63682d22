"""Compile artifacts: `graphinfer compile` writes a directory that `serve` / `generate --artifact` /
`LLM(artifact=)` start from without the original checkpoint, tracing, passes, re-fusing or (on GPUs) kernel
compilation. Layout (docs/architecture.md):

  manifest.json      what the graph was compiled for (model fingerprint, versions, platform, dtype, graph mode,
                     capture sizes, passes with matches and their numeric check, the piecewise split), the fused
                     projections, the plugin passes the graph needs, and the sha256 of every file below
  graph.py           the fused graph's Python code (torch.fx codegen with its import block)
  config.json        the model config (HF's to_dict()), read back without transformers' model classes
  model.safetensors  the weights as the graph reads them: fused (qkv_proj, gate_up_proj), quantized layers in
                     their packed form (manifest "quantization": each layer's scheme), the rest in the
                     artifact's dtype; loaded straight to the device. Compiled for tensor_parallel_size N > 1:
                     model-rank{r}-of-{N}.safetensors, rank r's shard, which only rank r loads (graph.py is the
                     same code on every rank). Compiled for pipeline_parallel_size P > 1: N = tp x P files, r the
                     rank in the replica (its stage's layers only), and graph-stage{s}-of-{P}.py per stage instead
                     of graph.py
  tokenizer/         the tokenizer in HF form (tokenizer.json, tokenizer_config.json, chat template); absent for
                     models without one
  added_modules.pt   only when passes added submodules or tensors the checkpoint does not have (torch.save);
                     per rank like the weights at N > 1
  kernel_cache/      GPU platforms: the compiled kernels (compiler/kernel_cache.py)
  report.txt         the pass table and op histogram, for people

Loading imports the plugin passes' modules (their ops must be registered before graph.py runs), builds the
model on the meta device with the fused projections in place, loads the weights into it, puts back what
passes added, and executes graph.py over the model's modules. An artifact made for other graphinfer / torch /
python versions, platform or dtype, for another model than the one named with it, plugins that are missing or
at other versions here, or whose files were edited, is refused (each tensor-parallel rank checks the files it
reads); so is one compiled for another tensor_parallel_size or expert-parallel setting (runtime/llm_engine.py).
"""
import dataclasses
import importlib
import importlib.metadata
import json
import os
import platform as py_platform
import re
import shutil

import torch
from torch import fx, nn

import graphinfer
from graphinfer.compiler.fingerprint import file_sha256 as _file_sha256
from graphinfer.compiler.report import histogram_table, pass_table
from graphinfer.compiler.split import SplitInfo
from graphinfer.compiler.trace import op_histogram
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import ArtifactMismatchError, InvalidConfigError
from graphinfer.models.layers import init_buffers
from graphinfer.models.loader import PlainConfig, load_fast_tokenizer, meta_model
from graphinfer.lora.slots import LoRASlots
from graphinfer.passes import CheckResult, PassError, PassReport, PassReports
from graphinfer.passes.utils import release_fused_sources
from graphinfer.quantization import install_quantized_linears, model_schemes
from graphinfer.quantization.linear import QuantizedEmbedding, QuantizedLinear, tie_quantized_head
from graphinfer.quantization.scheme import QuantScheme

FORMAT = 2  # 2: self-contained (config, final weights, tokenizer, kernel cache); 1 needed the checkpoint
MANIFEST, GRAPH, REPORT, ADDED = "manifest.json", "graph.py", "report.txt", "added_modules.pt"
CONFIG, WEIGHTS, TOKENIZER = "config.json", "model.safetensors", "tokenizer"
_REQUIRED = ("format", "model", "graphinfer_version", "torch_version", "python_version", "platform", "dtype",
             "graph_mode", "capture_sizes", "passes", "fused_linears", "files")


def environment(device: torch.device) -> dict:
    return {"graphinfer_version": graphinfer.__version__, "torch_version": torch.__version__,
            "python_version": py_platform.python_version(), "platform": device.type}


def graph_source(gm: fx.GraphModule) -> str:
    from torch.fx.graph_module import _format_import_block  # what GraphModule pickling itself uses
    from torch.package import sys_importer

    code = gm.graph.python_code(root_module="self")
    return f"# graphinfer compiled graph (torch.fx codegen)\n{_format_import_block(code.globals, sys_importer)}\n{code.src}"


def rank_file(name: str, rank: int, size: int) -> str:
    """The file of rank `rank` of `size` tensor-parallel ranks: `name` itself at size 1 (model.safetensors), else
    vLLM's sharded-state style (model-rank0-of-2.safetensors)."""
    if size == 1:
        return name
    stem, _, ext = name.partition(".")
    return f"{stem}-rank{rank}-of-{size}.{ext}"


_RANK_FILE = re.compile(r"(model|added_modules)-rank\d+-of-\d+\.(safetensors|pt)|graph-stage\d+-of-\d+\.py")


def stage_graph_file(stage: int, pp: int) -> str:
    """Pipeline stage `stage`'s graph code: graph.py at pp 1, else graph-stage{s}-of-{pp}.py."""
    if pp == 1:
        return GRAPH
    stem, _, ext = GRAPH.partition(".")
    return f"{stem}-stage{stage}-of-{pp}.{ext}"


def pipeline_parallel_size(manifest: dict) -> int:
    return manifest.get("pipeline_parallel_size", 1)  # absent from artifacts made before pipeline parallel: 1


def replica_size(manifest: dict) -> int:
    """Weight files (one per rank of a replica: tp x pp)."""
    return tensor_parallel_size(manifest) * pipeline_parallel_size(manifest)


def tensor_parallel_size(manifest: dict) -> int:
    return manifest.get("tensor_parallel_size", 1)  # absent from artifacts made before tensor parallelism: 1


def expert_parallel(manifest: dict) -> bool:
    """Whether the artifact's MoE experts are partitioned over its ranks (absent before expert parallel: no)."""
    return manifest.get("enable_expert_parallel", False)


def prepare_dir(out_dir: str, gm: fx.GraphModule, model: nn.Module) -> None:
    """Refuse passes a loaded artifact could not import (before anything is written), then clear out_dir of what
    an earlier compile into it may have left: every rank writes its files into it next."""
    _plugins(gm)
    _added_state(gm, model)
    os.makedirs(out_dir, exist_ok=True)
    for name in os.listdir(out_dir):
        path = os.path.join(out_dir, name)
        if name == TOKENIZER and os.path.isdir(path):
            shutil.rmtree(path)
        elif name in (ADDED, WEIGHTS) or _RANK_FILE.fullmatch(name):
            os.remove(path)


def save_rank_files(out_dir: str, gm: fx.GraphModule, model: nn.Module, rank: int = 0, size: int = 1) -> None:
    """Write the tensors of rank `rank` of `size` (the only rank at size 1): its final weights, and what passes
    added to its graph beyond the model."""
    from safetensors.torch import save_file

    added = _added_state(gm, model)
    if added:
        added_path = os.path.join(out_dir, rank_file(ADDED, rank, size))
        try:
            torch.save(added, added_path + ".tmp")
        except Exception as e:
            raise PassError(f"Modules added by passes ({', '.join(added)}) cannot be saved with torch.save "
                            f"({type(e).__name__}: {e}); a pass's modules must be picklable (module-level classes "
                            f"holding tensors).") from None
        os.replace(added_path + ".tmp", added_path)
    save_file(final_weights(gm, model), os.path.join(out_dir, rank_file(WEIGHTS, rank, size)),
              metadata={"format": "pt"})


def save_artifact(out_dir: str, gm: fx.GraphModule, reports: list[PassReport], *, fingerprint: dict,
                  device: torch.device, dtype: torch.dtype, graph_mode: str, capture_sizes: list[int],
                  model: nn.Module, hf_config, tokenizer=None, split: SplitInfo | None = None,
                  check: dict | None = None, tensor_parallel_size: int = 1, expert_parallel: bool = False,
                  quantization: str | None = None, speculative_config: dict | None = None,
                  model_impl: str = "graphinfer", pipeline_parallel_size: int = 1,
                  pp_layer_partition: list[int] | None = None, fused_linears: dict | None = None) -> dict:
    """Complete the artifact in out_dir (prepare_dir'ed, every rank's save_rank_files done): the graph, config,
    tokenizer, report and the manifest hashing every file. model: the module tree gm was traced from; hf_config /
    tokenizer: the model's, saved in HF form; check: how the pass checks were judged ({passed, atol, rtol,
    overridden}). Pipeline parallel: each stage's TP rank 0 wrote its stage's graph (stage_graph_file) and every
    rank its weights (rank_file by its rank in the replica); fused_linears: every stage's (the graph's here are
    stage 0's)."""
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    weights = [rank_file(WEIGHTS, r, tp * pp) for r in range(tp * pp)]
    if missing := [w for w in weights if not os.path.isfile(os.path.join(out_dir, w))]:
        raise InvalidConfigError(f"{', '.join(missing)} did not appear in {out_dir!r}, where those ranks wrote their "
                                 f"weights: across nodes, compile into a directory every node shares at that path.")
    e2e = getattr(reports, "end_to_end", None)
    manifest = {
        "format": FORMAT, "model": fingerprint, **environment(device), "dtype": str(dtype).removeprefix("torch."),
        "tensor_parallel_size": tp,  # rank r loads its own shard, rank_file(WEIGHTS, r, tp x pp)
        "pipeline_parallel_size": pp,  # stage s runs stage_graph_file(s, pp) over its layers
        "pp_layer_partition": pp_layer_partition,  # layers per stage
        "enable_expert_parallel": expert_parallel,  # MoE experts partitioned over the ranks (only if that applies)
        "graph_mode": graph_mode, "capture_sizes": capture_sizes, "passes": [r.to_json() for r in reports],
        "end_to_end_check": e2e.to_json() if e2e is not None else None,
        "check": check,
        "plugins": _plugins(gm),  # plugin passes: imported (at these versions) before graph.py runs
        "added_modules": sorted(_added_state(gm, model)),
        "fused_linears": fused_linears if fused_linears is not None else gm.meta.get("fused_linears", {}),
        "quantization": quantized_layers(gm, model, quantization),  # rebuilt as QuantizedLinears, then loaded
        "split": dataclasses.asdict(split) if split is not None else None,  # PIECEWISE: the pieces around attention
        "speculative_config": speculative_config,  # the default of `serve ART` (verify graphs captured for its k)
        "model_impl": model_impl,  # "transformers": the module tree is transformers' (models/transformers.py)
        "enable_lora": any(isinstance(m, LoRASlots) for m in gm.modules()),  # LoRA slots: sized when loaded
    }
    with open(os.path.join(out_dir, CONFIG), "w") as f:
        json.dump(hf_config.to_dict(), f, indent=2, sort_keys=True, default=str)
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(out_dir, TOKENIZER))
    if pp == 1:  # (pipeline parallel: each stage wrote its own)
        with open(os.path.join(out_dir, GRAPH), "w") as f:
            f.write(graph_source(gm))
    # safetensors writes its file owner-only; give it the mode the umask gives the other files (movable, servable)
    for name in weights:
        os.chmod(os.path.join(out_dir, name), os.stat(os.path.join(out_dir, CONFIG)).st_mode & 0o777)
    manifest["files"] = {name: _file_sha256(os.path.join(out_dir, name)) for name in _artifact_files(out_dir, tp, pp)}
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    plugins = manifest["plugins"]
    with open(os.path.join(out_dir, REPORT), "w") as f:
        f.write(f"graphinfer compile report\n\nmodel: {fingerprint['path']}\nplatform: {device.type}, dtype: "
                f"{manifest['dtype']}, graph mode: {graph_mode}, tensor_parallel_size: {tp}, "
                + (f"pipeline_parallel_size: {pp} (the passes and nodes below: stage 0's), " if pp > 1 else "")
                + f"expert parallel: {'on' if expert_parallel else 'off'}\n\n## Passes\n\n"
                f"{pass_table(reports)}\n\n"
                + (f"plugins: {', '.join(_plugin_name(p) for p in plugins)}\n\n" if plugins else "")
                + ("numeric check FAILED, artifact written anyway (--allow-check-failure): "
                   f"{'; '.join(check['failures'])}\n\n" if check and check.get("overridden") else "")
                + f"## Nodes in the compiled graph ({len(gm.graph.nodes)})\n\n{histogram_table(op_histogram(gm))}\n"
                + (f"\n## Piecewise split\n\n{split.summary()}\n" if split is not None else ""))
    return manifest


def _artifact_files(art_dir: str, tp: int, pp: int = 1) -> list[str]:
    """The files the manifest hashes: all but itself, the report and the kernel cache (which Triton extends)."""
    per_rank = [rank_file(name, r, tp * pp) for name in (WEIGHTS, ADDED) for r in range(tp * pp)]
    graphs = [stage_graph_file(s, pp) for s in range(pp)]
    names = [n for n in (*graphs, CONFIG, *per_rank) if os.path.isfile(os.path.join(art_dir, n))]
    tok = os.path.join(art_dir, TOKENIZER)
    if os.path.isdir(tok):
        names += sorted(f"{TOKENIZER}/{n}" for n in os.listdir(tok))
    return names


def final_weights(gm: fx.GraphModule, model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors the graph reads, by path: the model's state with the fused projections (which live in gm)
    in place of their sources, each stored once (a tied LM head is the embedding's)."""
    state = dict(model.state_dict())
    for target in gm.meta.get("fused_linears", {}):
        for name, t in gm.get_submodule(target).named_parameters():
            state[f"{target}.{name}"] = t
    seen, out = set(), {}
    for name, t in state.items():
        key = (t.data_ptr(), t.shape, t.stride())
        if key not in seen:  # tied weights: the model ties them again after loading
            seen.add(key)
            out[name] = t.detach().contiguous()
    return out


def quantized_layers(gm: fx.GraphModule, model: nn.Module, method: str | None) -> dict | None:
    """{"method", "layers": path -> QuantScheme dict} of the quantized layers the graph reads (the model's and the
    fused projections), or None for an unquantized model."""
    layers = model_schemes(model)
    for target in gm.meta.get("fused_linears", {}):
        if isinstance(fused := gm.get_submodule(target), QuantizedLinear):
            layers[target] = fused.scheme.to_dict()
    if not layers:
        return None
    return {"method": method, "layers": layers}


def _linear_module(obj) -> bool:
    return type(obj) in (nn.Linear, QuantizedLinear)


def _plugin_name(p: dict) -> str:
    return f"{p['pass']} ({p['distribution']} {p['version']})" if p.get("distribution") else f"{p['pass']} ({p['module']})"


def _plugins(gm: fx.GraphModule) -> list[dict]:
    """The plugin passes that ran on gm (recorded by the PassManager), checked to be importable by name."""
    plugins = gm.meta.get("plugin_passes", [])
    for p in plugins:
        if p["module"] == "__main__" or "<locals>" in p["class"]:
            raise PassError(
                f"Pass {p['pass']!r} is defined in {'a function' if '<locals>' in p['class'] else 'the main script'} "
                f"({p['module']}:{p['class']}), so a loaded artifact could not import it (and the ops it registers). "
                f"Move it into an importable module, best a plugin package (docs/passes.md), and compile again.")
    return plugins


def _same(a, b) -> bool:
    return a is b or (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.data_ptr() == b.data_ptr()
                      and a.shape == b.shape and a.dtype == b.dtype and a.data_ptr() != 0)


def _added_state(gm: fx.GraphModule, model: nn.Module) -> dict[str, object]:
    """target -> module or tensor, for each module or tensor the graph uses that is not the model's own at that
    path (passes added or replaced it), except the fused projections the fused_linears recipe rebuilds. A
    tensor read from a module that a pass added is saved as that whole module."""
    fused = gm.meta.get("fused_linears", {})
    added: dict[str, object] = {}

    def model_has(target: str, obj=None) -> bool:
        """model has something at target (obj None) / has obj itself there."""
        try:
            here = _resolve(model, target)
        except AttributeError:
            return False
        return obj is None or _same(obj, here)

    for node in gm.graph.nodes:
        if node.op not in ("call_module", "get_attr"):
            continue
        target = node.target
        if target in added or any(target.startswith(t + ".") for t in added):
            continue
        obj = _resolve(gm, target)
        if (target in fused and _linear_module(obj)) or model_has(target, obj):
            continue
        parent = target.rpartition(".")[0]
        if node.op == "get_attr" and parent:
            if parent in fused and _linear_module(gm.get_submodule(parent)):
                continue  # a fused projection's weight: the recipe rebuilds it
            if not model_has(parent):
                target, obj = parent, gm.get_submodule(parent)  # a module a pass added: saved whole
        added[target] = obj
    for target, obj in added.items():
        for cls in {type(m) for m in obj.modules()} if isinstance(obj, nn.Module) else ():
            if cls.__module__ == "__main__" or "<locals>" in cls.__qualname__:
                raise PassError(
                    f"A pass added the submodule {target!r} of class {cls.__module__}.{cls.__qualname__}, which a "
                    f"loaded artifact could not import: define the class at module level in an importable module "
                    f"(the plugin's package) and compile again.")
    return added


def _resolve(root: nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def read_manifest(art_dir: str) -> dict:
    path = os.path.join(art_dir, MANIFEST)
    if not os.path.isfile(path):
        raise ArtifactMismatchError(f"{art_dir!r} is not a graphinfer artifact (no {MANIFEST}); "
                                    f"make one with `graphinfer compile MODEL -o {art_dir}`.")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except json.JSONDecodeError as e:
        raise ArtifactMismatchError(f"{path} is not valid JSON ({e}); recompile the artifact.") from None
    if isinstance(manifest.get("format"), int) and manifest["format"] < FORMAT:
        raise ArtifactMismatchError(
            f"{art_dir!r} is an artifact of an older graphinfer (format {manifest['format']}, this one reads "
            f"{FORMAT}: artifacts now hold the weights, config and tokenizer themselves). Re-run `graphinfer compile "
            f"{manifest.get('model', {}).get('path', 'MODEL')} -o {art_dir}`.")
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing or manifest.get("format") != FORMAT:
        raise ArtifactMismatchError(f"{path} is damaged or of another format (missing {missing}, format "
                                    f"{manifest.get('format')!r}, expected {FORMAT}); recompile the artifact.")
    return manifest


def verify_artifact(art_dir: str, manifest: dict, *, device: torch.device, dtype: torch.dtype,
                    fingerprint: dict | None = None) -> None:
    """Raise ArtifactMismatchError naming every difference between the artifact and what would run it: the
    environment, the dtype, the hash of each file this rank reads (the shared files and its own weights: each
    tensor-parallel rank checks its own, on its node), and (fingerprint: of a model named together with the
    artifact) the model it was compiled from."""
    expected = {"dtype": (manifest["dtype"], str(dtype).removeprefix("torch."))}
    if fingerprint is not None:
        expected["model config"] = (manifest["model"]["config_sha256"], fingerprint["config_sha256"])
        expected["model weights"] = (manifest["model"]["weights_sha256"], fingerprint["weights_sha256"])
    expected.update({k: (manifest[k], v) for k, v in environment(device).items()})
    tp, pp, n = tensor_parallel_size(manifest), pipeline_parallel_size(manifest), replica_size(manifest)
    others = {rank_file(name, r, n) for name in (WEIGHTS, ADDED) for r in range(n) if r != ps.replica_rank()}
    others |= {stage_graph_file(s, pp) for s in range(pp) if s != ps.pp_rank()}
    for name, digest in manifest["files"].items():
        if name in others:
            continue
        path = os.path.join(art_dir, name)
        expected[name] = (digest, _file_sha256(path) if os.path.isfile(path) else "missing")
    diffs = [f"{k}: artifact has {a!r}, here {b!r}" for k, (a, b) in expected.items() if a != b]
    installs = []
    for p in manifest.get("plugins") or []:
        if p.get("distribution") is None:
            continue
        try:
            here = importlib.metadata.version(p["distribution"])
        except importlib.metadata.PackageNotFoundError:
            here = "not installed"
        if here != p["version"]:
            diffs.append(f"plugin {p['distribution']} (pass {p['pass']!r}): artifact has {p['version']!r}, here {here!r}")
            installs.append(f"{p['distribution']}=={p['version']}")
    if diffs:
        fix = f"\nInstall the plugins it was compiled with (pip install {' '.join(installs)}) or recompile it here: " \
            if installs else "\nRecompile it here: "
        model = fingerprint["path"] if fingerprint is not None else manifest["model"]["path"]
        raise ArtifactMismatchError(
            f"Artifact {art_dir!r} does not match this model / environment:\n  " + "\n  ".join(diffs) +
            f"{fix}graphinfer compile {model} -o {art_dir}" + (f" --tensor-parallel-size {tp}" if tp > 1 else "")
            + (f" --pipeline-parallel-size {pp}" if pp > 1 else ""))


def load_reports(manifest: dict) -> PassReports:
    """The pass reports recorded at compile time (with the end-to-end check, where recorded)."""
    e2e = manifest.get("end_to_end_check")
    return PassReports([PassReport(**r) for r in manifest["passes"]], CheckResult.from_json(e2e) if e2e else None)


def load_config(art_dir: str) -> PlainConfig:
    with open(os.path.join(art_dir, CONFIG)) as f:
        return PlainConfig(json.load(f))


def load_tokenizer(art_dir: str):
    """The artifact's tokenizer, or None for a model that has none."""
    path = os.path.join(art_dir, TOKENIZER)
    return load_fast_tokenizer(path) if os.path.isdir(path) else None


def load_model(art_dir: str, manifest: dict, config, device: torch.device) -> nn.Module:
    """The model with the artifact's final weights, loaded straight to `device`: built on the meta device with
    the fused projections in place of their sources, then given the saved tensors (no copy, no re-fuse). In a
    tensor-parallel group: this rank's shard of the model, from this rank's file."""
    from safetensors.torch import load_file

    transformers = manifest.get("model_impl") == "transformers"
    if transformers:  # transformers' module tree (this rank's shard), built by transformers from its config.json
        from transformers import AutoConfig

        from graphinfer.models.transformers import TransformersForCausalLM

        model = TransformersForCausalLM.skeleton(AutoConfig.from_pretrained(art_dir), getattr(torch, manifest["dtype"]),
                                                 device)
    else:
        model = meta_model(config)
    quant = {name: QuantScheme(**s) for name, s in ((manifest.get("quantization") or {}).get("layers") or {}).items()}
    dtype = getattr(torch, manifest["dtype"])
    install_quantized_linears(model, quant, "meta", dtype, tied=getattr(config, "tie_word_embeddings", False))
    fused_linears = {t: src for t, src in manifest["fused_linears"].items()
                     if _has_module(model, src[0])}  # (pipeline parallel: this stage's)
    for target, sources in fused_linears.items():
        mods = [model.get_submodule(s) for s in sources]
        parent, _, name = target.rpartition(".")
        with torch.device("meta"):
            in_f, out_f, bias = mods[0].in_features, sum(m.out_features for m in mods), mods[0].bias is not None
            fused = QuantizedLinear(in_f, out_f, quant[target], bias, dtype=dtype) if target in quant else \
                nn.Linear(in_f, out_f, bias=bias)
        setattr(model.get_submodule(parent), name, fused)
    release_fused_sources(model, fused_linears)
    weights = rank_file(WEIGHTS, ps.replica_rank(), replica_size(manifest))  # meta_model built this rank's shapes
    state = load_file(os.path.join(art_dir, weights), device=str(device))
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    if isinstance(getattr(model.model, "embed_tokens", None), QuantizedEmbedding) and config.tie_word_embeddings:
        tie_quantized_head(model)  # assign=True gave the embedding new tensors: the head follows
    missing = [k for k in missing if model.get_parameter(k).is_meta] if missing else []
    if missing or unexpected:
        raise ArtifactMismatchError(f"Artifact {art_dir!r}: {weights} does not fit the model of its {CONFIG} "
                                    f"(missing {missing[:3]}, unexpected {unexpected[:3]}); recompile the artifact.")
    for module in model.modules():  # non-persistent buffers (KV-cache placeholders, rotary caches)
        for name, buf in module._buffers.items():
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)  # not empty_like:
                # on a meta tensor that runs through torch._refs, which imports sympy
    init_buffers(model, device)
    return model.eval()


def _has_module(model: nn.Module, path: str) -> bool:
    try:
        model.get_submodule(path)
        return True
    except AttributeError:  # another pipeline stage's (a PPMissingLayer has no children)
        return False


def load_graph(art_dir: str, manifest: dict, model: nn.Module) -> nn.Module:
    """The artifact's compiled forward over `model`'s modules (plugins imported, modules added by passes put
    back)."""
    for p in manifest.get("plugins") or []:
        try:
            importlib.import_module(p["module"])  # registers the plugin's ops, defines its modules' classes
        except Exception as e:
            raise ArtifactMismatchError(
                f"Artifact {art_dir!r} needs the plugin pass {p['pass']!r} (module {p['module']}"
                f"{', distribution ' + p['distribution'] if p.get('distribution') else ''}), which fails to import "
                f"here: {type(e).__name__}: {e}. Install it, or recompile without it.") from None
    added = os.path.join(art_dir, rank_file(ADDED, ps.replica_rank(), replica_size(manifest)))
    if manifest.get("added_modules") and os.path.isfile(added):  # (pipeline parallel: a stage may have none)
        _install_added(model, torch.load(added, weights_only=False, map_location=next(model.parameters()).device))
    namespace: dict = {}
    graph_file = os.path.join(art_dir, stage_graph_file(ps.pp_rank(), pipeline_parallel_size(manifest)))
    with open(graph_file) as f:
        try:
            exec(compile(f.read(), graph_file, "exec"), namespace)
        except ImportError as e:
            raise ArtifactMismatchError(f"Artifact {art_dir!r}: graph.py imports what is not installed here ({e}); "
                                        f"install it or recompile.") from None
    graph = type("ArtifactGraph", (nn.Module,), {"forward": namespace["forward"]})()
    for attr in ("_modules", "_parameters", "_buffers"):  # run over the model's own modules, caches included
        setattr(graph, attr, getattr(model, attr))
    return graph


def _install_added(model: nn.Module, added: dict) -> None:
    """Put modules / tensors that passes added at their paths in model (creating empty parents as needed)."""
    for target, obj in added.items():
        parent = model
        *path, name = target.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        if isinstance(obj, nn.Module):
            setattr(parent, name, obj)
        elif isinstance(obj, nn.Parameter):
            parent.register_parameter(name, obj)
        else:
            if name in parent._parameters:
                del parent._parameters[name]
            parent.register_buffer(name, obj, persistent=False)
