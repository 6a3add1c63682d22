"""Imports go downward only: every module's imports (module level and inside functions), parsed with ast, against
the package order below. A package may import its own layer and the layers below it; an import of a higher layer
fails, unless it is a function-level import on the short allow-list of documented lazy upward imports."""
import ast
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "graphinfer"

# Bottom to top. Packages in one layer may import each other.
LAYERS = [
    {"graphinfer", "errors", "envs"},  # the package root: __version__, LLM & co. exported lazily (importlib, by name);
    # errors; envs, where every GRAPHINFER_* variable is read
    {"config", "sampling_params", "outputs"},  # plain dataclasses a user builds
    {"engine_args"},  # LLM(**kwargs) and the CLI flags, generated from EngineConfig's fields
    {"ops", "distributed"},  # the op vocabulary, collectives included (communication_op registers graphinfer:: ops)
    {"platforms"},  # which implementation each op gets, device graphs, streams: plugins that name, never import, a compiler
    {"models"},  # plain PyTorch models, their parallel layers, and the pieces of reading a checkpoint into them
    {"quantization"},  # quantized layers, built on the models' parallel layers and checkpoint readers
    {"model_loader"},  # load_model: a model with its weights, quantized layers installed where asked
    {"passes"},  # graph rewrites over the op vocabulary
    {"compiler"},  # trace -> passes -> lowering -> split (compiler/pipeline.py), artifacts
    {"runtime"},  # engine, scheduler, KV cache, model runner, device-graph capture and replay
    {"server", "bench"},  # what serves and measures an engine
    {"cli"},
]

# (importing module, imported package): function-level imports that go up a layer, each for a reason.
ALLOWED_LAZY_UPWARD = {
    # config validates dtype and quantization against the platform and the quantization methods at construction;
    # both sit above config (they use its dataclasses' neighbours), so config asks them only when it is built.
    ("graphinfer.config", "platforms"),
    ("graphinfer.config", "quantization"),
    # EngineConfig.from_kwargs: flat keyword arguments -> the config, through the arguments engine_args makes from it
    ("graphinfer.config", "engine_args"),
    # an artifact's manifest supplies the settings it was compiled with as the defaults of LLM(artifact=...) / serve
    ("graphinfer.engine_args", "compiler"),
}

LEVEL = {pkg: i for i, layer in enumerate(LAYERS) for pkg in layer}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str | None:
    """graphinfer.<package> of a graphinfer module (its first component below the root), None outside graphinfer."""
    parts = module.split(".")
    if parts[0] != "graphinfer":
        return None
    return parts[1] if len(parts) > 1 else "graphinfer"


def _imports(path: pathlib.Path):
    """(imported graphinfer module, line, function-level?) for every import in the file."""
    module = _module_name(path)
    is_pkg = path.name == "__init__.py"
    tree = ast.parse(path.read_text())
    function_nodes = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function_nodes.update(id(n) for n in ast.walk(fn) if n is not fn)
    for node in ast.walk(tree):
        lazy = id(node) in function_nodes
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, lazy
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against this module's package
                base = module.split(".")[: len(module.split(".")) - node.level + is_pkg]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:  # `from graphinfer import ops` imports the package graphinfer.ops
                sub = target == "graphinfer" and ((ROOT / alias.name).is_dir() or (ROOT / f"{alias.name}.py").is_file())
                yield (f"{target}.{alias.name}" if sub else target), node.lineno, lazy


def _violations():
    found, used_allowances = [], set()
    for path in sorted(ROOT.rglob("*.py")):
        module = _module_name(path)
        src = _package(module)
        assert src in LEVEL, f"{module}: package {src!r} has no layer in LAYERS; add it where it belongs"
        for target, line, lazy in _imports(path):
            dst = _package(target)
            if dst is None or dst == src:
                continue
            assert dst in LEVEL, f"{module}:{line} imports {target}, whose package has no layer in LAYERS"
            if LEVEL[dst] <= LEVEL[src]:
                continue
            if lazy and (module, dst) in ALLOWED_LAZY_UPWARD:
                used_allowances.add((module, dst))
                continue
            where = "inside a function" if lazy else "at module level"
            found.append(f"{path.relative_to(ROOT.parent)}:{line}: {src} (layer {LEVEL[src]}) imports {target} "
                         f"(layer {LEVEL[dst]}) {where}")
    return list(dict.fromkeys(found)), used_allowances  # `from m import a, b`: one line


def test_imports_go_downward():
    found, _ = _violations()
    assert not found, "upward imports between packages (see LAYERS in this file):\n  " + "\n  ".join(found)


def test_allow_list_is_current():
    """Every allowance is still needed: a lazy upward import that was moved away leaves no stale entry."""
    _, used = _violations()
    assert used == ALLOWED_LAZY_UPWARD, f"no longer needed: {sorted(ALLOWED_LAZY_UPWARD - used)}"


def test_checker_sees_function_level_and_relative_imports(tmp_path, monkeypatch):
    """The parser finds what a module imports inside a function and through relative imports."""
    pkg = tmp_path / "graphinfer" / "platforms"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "x.py").write_text("def f():\n    from graphinfer.compiler import pipeline\n\nfrom ..runtime import llm\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "graphinfer")
    found = sorted((t, lazy) for t, _, lazy in _imports(pkg / "x.py"))
    assert found == [("graphinfer.compiler", True), ("graphinfer.runtime", False)]
