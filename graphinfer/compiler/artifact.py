"""Compile artifacts: `graphinfer compile` writes a directory that `generate --artifact` / `LLM(artifact=)`
start from without tracing the model or running passes again.

  manifest.json  what the graph was compiled for (model fingerprint, versions, platform, dtype, graph mode,
                 capture sizes, passes with matches and max_abs_error, the piecewise split) and how to
                 rebuild fused weights
  graph.py       the fused graph's Python code (torch.fx codegen with its import block)
  report.txt     the pass table and op histogram, for people

Loading rebuilds each fused projection from the checkpoint's weights by the recorded recipe (a
concatenation, no pass logic) and executes graph.py over the model's modules. An artifact made for other
weights, graphinfer / torch / python versions, platform or dtype, or whose files were edited, is refused.
"""
import dataclasses
import hashlib
import json
import os
import platform as py_platform

import torch
from torch import fx, nn

import graphinfer
from graphinfer.compiler.report import histogram_table, pass_table
from graphinfer.compiler.split import SplitInfo
from graphinfer.compiler.trace import op_histogram
from graphinfer.errors import ArtifactMismatchError
from graphinfer.passes import PassReport
from graphinfer.passes.utils import concat_linears, release_fused_sources

FORMAT = 1
MANIFEST, GRAPH, REPORT = "manifest.json", "graph.py", "report.txt"
_REQUIRED = ("format", "model", "graphinfer_version", "torch_version", "python_version", "platform", "dtype",
             "graph_mode", "capture_sizes", "passes", "fused_linears", "graph_sha256")


def environment(device: torch.device) -> dict:
    return {"graphinfer_version": graphinfer.__version__, "torch_version": torch.__version__,
            "python_version": py_platform.python_version(), "platform": device.type}


def graph_source(gm: fx.GraphModule) -> str:
    from torch.fx.graph_module import _format_import_block  # what GraphModule pickling itself uses
    from torch.package import sys_importer

    code = gm.graph.python_code(root_module="self")
    return f"# graphinfer compiled graph (torch.fx codegen)\n{_format_import_block(code.globals, sys_importer)}\n{code.src}"


def save_artifact(out_dir: str, gm: fx.GraphModule, reports: list[PassReport], *, fingerprint: dict,
                  device: torch.device, dtype: torch.dtype, graph_mode: str, capture_sizes: list[int],
                  split: SplitInfo | None = None) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    source = graph_source(gm)
    manifest = {
        "format": FORMAT, "model": fingerprint, **environment(device), "dtype": str(dtype).removeprefix("torch."),
        "graph_mode": graph_mode, "capture_sizes": capture_sizes, "passes": [r.to_json() for r in reports],
        "fused_linears": gm.meta.get("fused_linears", {}),
        "graph_sha256": hashlib.sha256(source.encode()).hexdigest(),
        "split": dataclasses.asdict(split) if split is not None else None,  # PIECEWISE: the pieces around attention
    }
    with open(os.path.join(out_dir, GRAPH), "w") as f:
        f.write(source)
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
    with open(os.path.join(out_dir, REPORT), "w") as f:
        f.write(f"graphinfer compile report\n\nmodel: {fingerprint['path']}\nplatform: {device.type}, dtype: "
                f"{manifest['dtype']}, graph mode: {graph_mode}\n\n## Passes\n\n{pass_table(reports)}\n\n"
                f"## Nodes in the compiled graph ({len(gm.graph.nodes)})\n\n{histogram_table(op_histogram(gm))}\n"
                + (f"\n## Piecewise split\n\n{split.summary()}\n" if split is not None else ""))
    return manifest


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
    missing = [k for k in _REQUIRED if k not in manifest]
    if missing or manifest.get("format") != FORMAT:
        raise ArtifactMismatchError(f"{path} is damaged or of another format (missing {missing}, format "
                                    f"{manifest.get('format')!r}, expected {FORMAT}); recompile the artifact.")
    return manifest


def verify_artifact(art_dir: str, manifest: dict, *, fingerprint: dict, device: torch.device, dtype: torch.dtype) -> None:
    """Raise ArtifactMismatchError naming every difference between the artifact and what would run it."""
    expected = {"model config": (manifest["model"]["config_sha256"], fingerprint["config_sha256"]),
                "model weights": (manifest["model"]["weights_sha256"], fingerprint["weights_sha256"]),
                "dtype": (manifest["dtype"], str(dtype).removeprefix("torch."))}
    expected.update({k: (manifest[k], v) for k, v in environment(device).items()})
    with open(os.path.join(art_dir, GRAPH)) as f:
        expected["graph.py"] = (manifest["graph_sha256"], hashlib.sha256(f.read().encode()).hexdigest())
    diffs = [f"{k}: artifact has {a!r}, here {b!r}" for k, (a, b) in expected.items() if a != b]
    if diffs:
        raise ArtifactMismatchError(
            f"Artifact {art_dir!r} does not match this model / environment:\n  " + "\n  ".join(diffs) +
            f"\nRecompile it here: graphinfer compile {fingerprint['path']} -o {art_dir}")


def load_graph(art_dir: str, manifest: dict, model: nn.Module) -> nn.Module:
    """The artifact's compiled forward over `model`'s modules (fused projections rebuilt from its weights)."""
    for target, sources in manifest["fused_linears"].items():
        parent, _, name = target.rpartition(".")
        setattr(model.get_submodule(parent), name, concat_linears([model.get_submodule(s) for s in sources]))
    release_fused_sources(model, manifest["fused_linears"])
    namespace: dict = {}
    with open(os.path.join(art_dir, GRAPH)) as f:
        exec(compile(f.read(), os.path.join(art_dir, GRAPH), "exec"), namespace)
    graph = type("ArtifactGraph", (nn.Module,), {"forward": namespace["forward"]})()
    for attr in ("_modules", "_parameters", "_buffers"):  # run over the model's own modules, caches included
        setattr(graph, attr, getattr(model, attr))
    return graph
