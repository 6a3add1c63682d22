"""Pass plugins as installed distributions: loaded lazily, isolated when broken, never shadowing a built-in;
artifacts that record them (distribution and version), import them before their graph, put back the modules
their passes added, and are refused clearly without them. The artifact tests use the plugin docs/passes.md
walks through (its own op and an added submodule), built and installed with pip."""
import json
import os
import shutil
import subprocess
import sys
import warnings

import pytest
from torch import nn

from graphinfer import LLM, SamplingParams
from graphinfer.errors import ArtifactMismatchError, InvalidConfigError
from graphinfer.passes import DEFAULT_PASSES, Pass, PassError, PluginWarning, available_passes, resolve_passes
from graphinfer.compiler import pass_tools as tools
from plugin_utils import install_docs_plugin, make_dist

BIN = os.path.join(os.path.dirname(sys.executable), "graphinfer")
GOOD = '''
import os
from graphinfer.passes import Pass

open(os.environ["GI_PLUGIN_IMPORTS"], "a").write("good\\n")  # records each import


class Noop(Pass):
    name = "noop_plugin"
    description = "does nothing (test plugin)"

    def apply(self, gm):
        return 0
'''
BROKEN_IMPORT = "import graphinfer_missing_dependency  # not installed\n"
RAISES = "raise RuntimeError('plugin init failed')\n"
NOT_A_PASS = "NotAPass = 42\n"
SHADOW = '''
from graphinfer.passes import Pass


class MyCleanup(Pass):
    name = "cleanup"
    description = "claims a built-in's name"

    def apply(self, gm):
        return 0
'''


@pytest.fixture
def plugins(tmp_path, monkeypatch):
    """Installs test distributions on sys.path; returns a function (dist, modules, entry points) -> path."""
    log = tmp_path / "imports.log"
    log.write_text("")
    monkeypatch.setenv("GI_PLUGIN_IMPORTS", str(log))

    def add(dist, modules, eps):
        root = make_dist(tmp_path / dist, dist, modules, eps)
        monkeypatch.syspath_prepend(root)
        return root

    add.log = log
    return add


def _broken(plugins):
    plugins("gi-broken-import", {"gi_broken_import": BROKEN_IMPORT}, {"broken_import": "gi_broken_import:Pass"})
    plugins("gi-raises", {"gi_raises": RAISES}, {"raises_at_import": "gi_raises:Pass"})
    plugins("gi-not-a-pass", {"gi_not_a_pass": NOT_A_PASS}, {"not_a_pass": "gi_not_a_pass:NotAPass"})


def test_broken_plugins_leave_everything_else_working(plugins, recwarn):
    _broken(plugins)
    plugins("gi-good", {"gi_good": GOOD}, {"noop_plugin": "gi_good:Noop"})
    # Built-in pipelines never import a plugin: no warning, no import.
    for spec in ("none", "default", "fuse_qkv,cleanup"):
        resolve_passes(spec)
    assert plugins.log.read_text() == "" and not [w for w in recwarn if w.category is PluginWarning]
    assert "gi_broken_import" not in sys.modules and "gi_raises" not in sys.modules
    llm = LLM("tiny-qwen3", num_gpu_blocks_override=32)
    assert [r.name for r in llm.llm_engine.worker.compiled.pass_reports] == list(DEFAULT_PASSES) and llm.llm_engine.worker.compiled.pass_reports.passed
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids) == 4
    # Asking for the good plugin imports it alone.
    assert [p.name for p in resolve_passes("default,noop_plugin")][-1] == "noop_plugin"
    assert plugins.log.read_text() == "good\n" and "gi_raises" not in sys.modules
    # Only a request for a broken plugin's pass fails, naming its distribution and the error.
    with pytest.raises(InvalidConfigError, match="(?s)gi-broken-import 0.1.*ModuleNotFoundError.*graphinfer_missing"):
        resolve_passes("default,broken_import")
    with pytest.raises(InvalidConfigError, match="gi-raises 0.1.*RuntimeError: plugin init failed"):
        resolve_passes("raises_at_import")
    with pytest.raises(InvalidConfigError, match="is 42, not a graphinfer.passes.Pass subclass"):
        resolve_passes("not_a_pass")


def test_passes_list_shows_broken_plugins_with_a_warning(plugins):
    _broken(plugins)
    with pytest.warns(PluginWarning) as caught:
        text = tools.list_passes()
        found = available_passes()
    messages = " | ".join(str(w.message) for w in caught)
    assert "gi-broken-import 0.1" in messages and "ModuleNotFoundError" in messages and "gi-raises 0.1" in messages
    assert "| broken_import (broken) | cannot be used: importing gi_broken_import:Pass failed" in text
    assert "| not_a_pass (broken) | cannot be used: gi_not_a_pass:NotAPass is 42" in text
    for name in DEFAULT_PASSES:
        assert f"| {name} |" in text and found[name].origin == "built-in"
    assert not any(name.startswith(("broken_import", "not_a_pass")) for name in found)
    text, reports = tools.verify("tiny-llama", "default")  # every built-in still runs
    assert reports.passed and all(r.matches for r in reports if r.name in ("fuse_qkv", "fuse_gate_up",
                                                                             "fuse_add_rmsnorm"))


def test_cli_passes_list_with_a_broken_plugin(tmp_path):
    root = make_dist(tmp_path, "gi-broken-import", {"gi_broken_import": BROKEN_IMPORT},
                     {"broken_import": "gi_broken_import:Pass"})
    res = subprocess.run([BIN, "passes", "list"], capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=root))
    assert res.returncode == 0 and "Traceback" not in res.stderr, res.stderr
    assert "PluginWarning" in res.stderr and "gi-broken-import 0.1" in res.stderr
    assert "| fuse_qkv |" in res.stdout and "| broken_import (broken) | cannot be used" in res.stdout


def test_a_plugin_shadowing_a_built_in_is_an_error_naming_both(plugins):
    plugins("gi-shadow", {"gi_shadow": SHADOW}, {"cleanup": "gi_shadow:MyCleanup"})
    with pytest.raises(InvalidConfigError, match="(?s)plugin 'cleanup' = gi_shadow:MyCleanup from distribution "
                                                 "gi-shadow 0.1 has the name of the built-in pass 'cleanup' "
                                                 r"\(graphinfer.passes.cleanup:CleanupPass\)"):
        resolve_passes("default")
    assert resolve_passes("fuse_qkv") and "gi_shadow" not in sys.modules  # other names are unaffected
    with pytest.warns(PluginWarning, match="has the name of the built-in"):
        text = tools.list_passes()
    assert "| cleanup (broken) |" in text and "| cleanup | dead code" in text


def test_a_plugin_whose_class_names_another_pass_is_refused(plugins):
    plugins("gi-misnamed", {"gi_misnamed": SHADOW.replace('"cleanup"', '"other_name"')},
            {"misnamed": "gi_misnamed:MyCleanup"})
    with pytest.raises(InvalidConfigError, match="says its name is 'other_name' but its entry point is named 'misnamed'"):
        resolve_passes("misnamed")


# ----- artifacts -----

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3]]


@pytest.fixture(scope="module")
def docs_plugin_site(tmp_path_factory):
    return install_docs_plugin(str(tmp_path_factory.mktemp("docs-plugin")))


@pytest.fixture(scope="module")
def fused_mlp_artifact(docs_plugin_site, tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(docs_plugin_site)
        llm = LLM("tiny-llama", passes="default,fused_mlp", num_gpu_blocks_override=32)
        art = str(tmp_path_factory.mktemp("fused-mlp") / "art")
        manifest = llm.llm_engine.save_artifact(art)
        return art, manifest, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.fixture
def plugin_on_path(docs_plugin_site, monkeypatch):
    monkeypatch.syspath_prepend(docs_plugin_site)


def test_artifact_with_a_plugin_round_trips(fused_mlp_artifact, plugin_on_path):
    art, manifest, tokens = fused_mlp_artifact
    assert manifest["plugins"] == [{"pass": "fused_mlp", "module": "graphinfer_fused_mlp.passes",
                                    "class": "FusedMLPPass", "distribution": "graphinfer-fused-mlp",
                                    "version": "0.1.0"}]
    assert manifest["added_modules"] == ["model.layers.0.mlp.down_proj_t", "model.layers.1.mlp.down_proj_t"]
    assert sorted(os.listdir(art)) == ["added_modules.pt", "config.json", "graph.py", "manifest.json", "model.safetensors",
                                       "report.txt"]
    assert "torch.ops.mlp_plugin.fused_mlp.default" in open(os.path.join(art, "graph.py")).read()
    assert "plugins: fused_mlp (graphinfer-fused-mlp 0.1.0)" in open(os.path.join(art, "report.txt")).read()
    loaded = LLM(artifact=art, num_gpu_blocks_override=32)
    module = loaded.llm_engine.worker.model.model.layers[1].mlp.down_proj_t
    assert type(module).__module__ == "graphinfer_fused_mlp.passes" and module.w_t.shape == (128, 64)
    assert [o.outputs[0].token_ids for o in loaded.generate(PROMPTS, GREEDY, use_tqdm=False)] == tokens
    assert tokens == [o.outputs[0].token_ids for o in
                      LLM("tiny-llama", passes="none", num_gpu_blocks_override=32).generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert [r.name for r in loaded.llm_engine.worker.compiled.pass_reports][-1] == "fused_mlp"
    assert loaded.llm_engine.worker.compiled.pass_reports.end_to_end.passed


def test_artifact_with_a_plugin_at_another_version_is_refused(fused_mlp_artifact, plugin_on_path, tmp_path):
    art = str(tmp_path / "other-version")
    shutil.copytree(fused_mlp_artifact[0], art)
    path = os.path.join(art, "manifest.json")
    m = json.load(open(path))
    m["plugins"][0]["version"] = "0.0.9"
    json.dump(m, open(path, "w"))
    with pytest.raises(ArtifactMismatchError, match="(?s)plugin graphinfer-fused-mlp \\(pass 'fused_mlp'\\): artifact "
                                                    "has '0.0.9', here '0.1.0'.*pip install graphinfer-fused-mlp==0.0.9"):
        LLM(artifact=art)


def test_artifact_with_edited_added_modules_is_refused(fused_mlp_artifact, plugin_on_path, tmp_path):
    art = str(tmp_path / "edited")
    shutil.copytree(fused_mlp_artifact[0], art)
    with open(os.path.join(art, "added_modules.pt"), "ab") as f:
        f.write(b"\0")
    with pytest.raises(ArtifactMismatchError, match="added_modules.pt: artifact has"):
        LLM(artifact=art)
    os.remove(os.path.join(art, "added_modules.pt"))
    with pytest.raises(ArtifactMismatchError, match="added_modules.pt: artifact has '[0-9a-f]+', here 'missing'"):
        LLM(artifact=art)


def test_artifact_without_its_plugin_is_refused_before_anything_runs(fused_mlp_artifact):
    art = fused_mlp_artifact[0]
    code = f"from graphinfer import LLM\nLLM(artifact={art!r})"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode != 0
    assert "ArtifactMismatchError" in res.stderr and "here 'not installed'" in res.stderr
    assert "pip install graphinfer-fused-mlp==0.1.0" in res.stderr


class LocalModulePass(Pass):
    """Adds a module whose class is defined inside a function: no loaded artifact could import it."""
    name = "local_module"

    def apply(self, gm):
        class Local(nn.Module):
            def forward(self, x):
                return x

        out = next(n for n in gm.graph.nodes if n.op == "output")
        gm.add_submodule("local", Local())
        with gm.graph.inserting_before(out):
            node = gm.graph.call_module("local", (out.args[0],))
        out.args = (node,)
        return 1


def test_compile_refuses_what_an_artifact_could_not_import(tmp_path):
    class InFunction(Pass):
        name = "in_function"

        def apply(self, gm):
            return 0

    with pytest.raises(PassError, match="Pass 'in_function' is defined in a function"):
        LLM("tiny-llama", passes=[InFunction()], num_gpu_blocks_override=32).llm_engine.save_artifact(str(tmp_path / "a"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM("tiny-llama", passes=["default", LocalModulePass()], num_gpu_blocks_override=32)
    with pytest.raises(PassError, match="added the submodule 'local' of class .*<locals>.Local"):
        llm.llm_engine.save_artifact(str(tmp_path / "b"))
    assert not os.path.exists(tmp_path / "b" / "manifest.json")
