"""Imports go downward only: every module's imports (module level and inside functions), parsed with ast, against
the package order below. A package may import its own layer and the layers below it; an import of a higher layer
fails, unless it is a function-level import on the short allow-list of documented lazy upward imports. And files
do not import each other in a circle (KNOWN_CYCLES: the few closed by function-level imports, still to break)."""
import ast
import functools
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent / "graphinfer"

# Bottom to top. Packages in one layer may import each other.
LAYERS = [
    {"graphinfer", "errors", "envs", "lazy_imports"},  # the package root: __version__, LLM & co. exported lazily
    # (importlib, by name); errors; envs, where every GRAPHINFER_* variable is read; lazy_imports, third-party
    # packages' eager imports deferred
    {"config", "sampling_params", "outputs"},  # plain dataclasses a user builds
    {"engine_args"},  # LLM(**kwargs) and the CLI flags, generated from EngineConfig's fields
    {"ops", "distributed"},  # the op vocabulary, collectives included (communication_op registers graphinfer:: ops)
    {"platforms"},  # which implementation each op gets, device graphs, streams: plugins that name, never import, a compiler
    {"models"},  # plain PyTorch models, their parallel layers, and the pieces of reading a checkpoint into them
    {"quantization", "lora", "eplb"},  # quantized layers, built on the models' parallel layers and checkpoint readers;
    # LoRA adapters (PEFT's format) read into per-module A / B weights; EPLB's balancing policy and expert-map
    # file (pure host code on torch / numpy: the runtime that counts load and moves expert weights builds on it)
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
    for target, line, lazy, name in _import_targets(path):
        # `from graphinfer import ops` imports the package graphinfer.ops
        sub = target == "graphinfer" and name and ((ROOT / name).is_dir() or (ROOT / f"{name}.py").is_file())
        yield (f"{target}.{name}" if sub else target), line, lazy


def _import_targets(path: pathlib.Path):
    """(imported module, line, function-level?, imported name or None) for every name an import binds; relative
    imports resolved against this module's package."""
    return _parsed_import_targets(path, _module_name(path), path.stat().st_mtime_ns)


@functools.cache  # every test walks every file; parse each (version of a) file once
def _parsed_import_targets(path: pathlib.Path, module: str, mtime_ns: int) -> tuple:
    return tuple(_walk_import_targets(path, module))


def _walk_import_targets(path: pathlib.Path, module: str):
    tree = ast.parse(path.read_text())
    function_nodes = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            function_nodes.update(id(n) for n in ast.walk(fn) if n is not fn)
    for node in ast.walk(tree):
        lazy = id(node) in function_nodes
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno, lazy, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                yield target, node.lineno, lazy, alias.name


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


# --- import cycles between files ------------------------------------------------------------------------------------
# Layers keep packages from importing upward; within a layer, and within a package, files must not import each other
# in a circle either. At module level none may (a circle there is an import-order bug waiting for its entry point).
# Counting function-level imports too (the usual way a circle is broken), the only circles are these, in runtime/,
# which is being rewritten; an import on ALLOWED_LAZY_UPWARD is documented already and not counted.
_RT = "graphinfer.runtime."
KNOWN_CYCLES: set[tuple[str, ...]] = set()  # none: add one here only with the reason and the plan to break it


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(path): path for path in sorted(ROOT.rglob("*.py"))}


def _import_graph(function_level: bool) -> dict[str, dict[str, str]]:
    """module -> {module it imports: "path:line"} over graphinfer's files: an import's target resolved to the file
    that runs (`from pkg import name` is pkg.name's file where that is a module, else pkg/__init__.py), plus the
    __init__.py of every package it enters from outside (Python runs those first)."""
    modules = _modules()

    def file_of(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: {} for m in modules}
    for module, path in modules.items():
        for target, line, lazy, name in _import_targets(path):
            if (lazy and not function_level) or _package(target) is None:
                continue
            dst = file_of(f"{target}.{name}") if name and f"{target}.{name}" in modules else file_of(target)
            if dst is None or (lazy and (module, _package(dst)) in ALLOWED_LAZY_UPWARD):
                continue
            parts = dst.split(".")
            entered = [".".join(parts[:i]) for i in range(2, len(parts))]  # packages above dst, root excluded
            for m in [dst, *(p for p in entered if not module.startswith(p + "."))]:
                if m != module:
                    graph[module].setdefault(m, f"{path.relative_to(ROOT.parent)}:{line}")
    return graph


def _cycles(graph: dict[str, dict[str, str]]) -> list[tuple[str, ...]]:
    """Every elementary cycle, as a tuple of modules starting at its least: per strongly connected component (Tarjan),
    a search from each member through the larger ones."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v):  # recursion depth: at most the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while not component or v not in component:
                component.add(stack.pop())
            on_stack.difference_update(component)
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        for start in sorted(component):
            paths = [(start,)]
            while paths:
                path = paths.pop()
                for w in sorted(graph[path[-1]]):
                    if w == start:
                        cycles.append(path)
                    elif w in component and w > start and w not in path:
                        paths.append((*path, w))
    return sorted(cycles)


def _describe(graph, cycle) -> str:
    hops = zip(cycle, (*cycle[1:], cycle[0]))
    return " -> ".join((*cycle, cycle[0])) + "  (" + ", ".join(graph[a][b] for a, b in hops) + ")"


def test_no_import_cycles_at_module_level():
    graph = _import_graph(function_level=False)
    cycles = _cycles(graph)
    assert not cycles, "files importing each other in a circle:\n  " + "\n  ".join(_describe(graph, c) for c in cycles)


def test_no_import_cycles_counting_function_level_imports():
    """Softer: circles closed by a function-level import are listed in KNOWN_CYCLES, and no others appear."""
    graph = _import_graph(function_level=True)
    new = [c for c in _cycles(graph) if c not in KNOWN_CYCLES]
    assert not new, ("files importing each other in a circle through function-level imports (move the shared piece "
                     "down instead):\n  " + "\n  ".join(_describe(graph, c) for c in new))


def test_known_cycles_are_current():
    """Every KNOWN_CYCLES entry is still a circle: one that was broken leaves no stale entry."""
    gone = KNOWN_CYCLES - set(_cycles(_import_graph(function_level=True)))
    assert not gone, f"no longer circles, remove them from KNOWN_CYCLES: {sorted(gone)}"


def test_cycle_finder_sees_planted_cycles(tmp_path, monkeypatch):
    """A module-level circle through a package's __init__ and a relative import, and one closed only inside a
    function, in a tree of their own."""
    root = tmp_path / "graphinfer"
    for pkg in ("a", "b"):
        (root / pkg).mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a/__init__.py": "from graphinfer.a.x import X\n",
        "a/x.py": "from ..b import y\nX = 1\n",  # relative: graphinfer.b.y
        "b/__init__.py": "",
        "b/y.py": "import graphinfer.a.z\n",  # enters graphinfer/a/__init__.py first
        "a/z.py": "def f():\n    from graphinfer.a import v\n",  # `from pkg import module`: the module's file
        "a/v.py": "from . import z\n",
    }
    for name, text in files.items():
        (root / name).write_text(text)
    monkeypatch.setattr(sys.modules[__name__], "ROOT", root)
    monkeypatch.setattr(sys.modules[__name__], "ALLOWED_LAZY_UPWARD", set())
    assert _cycles(_import_graph(function_level=False)) == [("graphinfer.a", "graphinfer.a.x", "graphinfer.b.y")]
    assert _cycles(_import_graph(function_level=True)) == [("graphinfer.a", "graphinfer.a.x", "graphinfer.b.y"),
                                                           ("graphinfer.a.v", "graphinfer.a.z")]
