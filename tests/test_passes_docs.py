"""docs/passes.md runs as written: its python blocks in order in one namespace, its bash lines (the
`graphinfer` ones in-process, the `pip install` one for real, installing the page's plugin package from the
files the page shows)."""
import os
import shlex

from graphinfer.cli import main
from graphinfer.passes import DEFAULT_PASSES
from plugin_utils import bash_commands, doc_blocks, install_docs_plugin, installed_docs_plugin


def test_every_snippet_in_passes_md_runs(tmp_path_factory, monkeypatch, capsys):
    site = install_docs_plugin(str(tmp_path_factory.mktemp("docs-plugin")))
    installed = installed_docs_plugin()
    monkeypatch.chdir(installed["workdir"])
    monkeypatch.syspath_prepend(site)
    monkeypatch.setenv("GRAPHINFER_LOG_LEVEL", "WARNING")
    namespace: dict = {"__name__": "passes_md"}
    outputs: dict[str, str] = {}
    counts = {"python": 0, "bash": 0, "file": 0}
    for block in doc_blocks():
        where = f"docs/passes.md:{block.line}"
        if block.file:
            counts["file"] += 1  # written and installed by install_docs_plugin
        elif block.lang == "python":
            exec(compile(block.code, where, "exec"), namespace)
            counts["python"] += 1
        elif block.lang == "bash":
            for argv in bash_commands(block):
                counts["bash"] += 1
                if argv[0] == "pip":
                    assert shlex.join(argv) == installed["command"]  # run (once) by install_docs_plugin
                    continue
                assert argv[0] == "graphinfer", f"{where}: only graphinfer and pip commands can be run: {argv}"
                rc = main(argv[1:])
                out = capsys.readouterr()
                assert rc == 0, f"{where}: {shlex.join(argv)} exited {rc}\n{out.err[-3000:]}"
                outputs[shlex.join(argv[1:3])] = outputs.get(shlex.join(argv[1:3]), "") + out.out
        else:
            assert block.lang in ("text", "toml"), f"{where}: a ```{block.lang} block the test does not know how to run"
    assert counts["python"] >= 8 and counts["bash"] >= 10 and counts["file"] == 4, counts

    # What the page says the commands show, they show.
    assert "| fused_mlp | down(silu_and_mul" in outputs["passes list"]
    assert "plugin (graphinfer-fused-mlp 0.1.0)" in outputs["passes list"]
    assert "all checks passed" in outputs["passes verify"] and "| fused_mlp | 2 |" in outputs["passes verify"]
    assert "mlp_plugin::fused_mlp" in outputs["passes diff"] and "## rewired" in outputs["passes diff"]
    assert "## Pass report" in outputs["generate --passes"] and "| fused_mlp | 30 |" in outputs["generate --passes"]
    assert "Paris" in outputs["generate --passes"]
    assert os.path.isfile("g.onnx") and os.path.isfile("fused-mlp-art/added_modules.pt")
    n = f"{len(DEFAULT_PASSES) + 1:02d}"  # the default pipeline, then fused_mlp
    assert {"00-traced.py", f"{n}-fused_mlp.py", f"{n}-fused_mlp.txt"} <= set(os.listdir("dump"))
    assert os.path.isfile("dump-python/01-fuse_gate_up.py")
