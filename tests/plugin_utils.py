"""Pass plugins for the tests, installed for real: throwaway distributions (a module and a *.dist-info with
entry_points.txt on sys.path, as pip leaves them), and the plugin docs/passes.md walks through, built from the
page's own files by the page's own `pip install` command (once per process)."""
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCS = os.path.join(ROOT, "docs", "passes.md")
PIP = os.path.join(os.path.dirname(sys.executable), "pip")


def make_dist(root, dist: str, modules: dict[str, str], entry_points: dict[str, str], version: str = "0.1") -> str:
    """Write modules {name: source} and a dist-info declaring `graphinfer.passes` entry points {name: 'mod:attr'}
    under root; returns root (put it on sys.path / PYTHONPATH)."""
    root = str(root)
    os.makedirs(root, exist_ok=True)
    for name, source in modules.items():
        with open(os.path.join(root, f"{name}.py"), "w") as f:
            f.write(source)
    info = os.path.join(root, f"{dist.replace('-', '_')}-{version}.dist-info")
    os.makedirs(info, exist_ok=True)
    with open(os.path.join(info, "METADATA"), "w") as f:
        f.write(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    with open(os.path.join(info, "entry_points.txt"), "w") as f:
        f.write("[graphinfer.passes]\n" + "".join(f"{k} = {v}\n" for k, v in entry_points.items()))
    return root


@dataclass
class Block:
    lang: str
    code: str
    file: str | None  # set for the blocks marked <!-- file: PATH -->: files of the example package
    line: int


def doc_blocks(path: str = DOCS) -> list[Block]:
    """The fenced code blocks of a markdown page, in order."""
    text = open(path).read()
    blocks = []
    for m in re.finditer(r"(?:<!-- file: (?P<file>\S+) -->\n)?```(?P<lang>\w*)\n(?P<code>.*?)\n```", text, re.S):
        blocks.append(Block(m["lang"], m["code"] + "\n", m["file"], text[: m.start()].count("\n") + 1))
    return blocks


def bash_commands(block: Block) -> list[list[str]]:
    return [argv for line in block.code.splitlines() if (argv := shlex.split(line, comments=True))]


_INSTALLED: dict[str, str] = {}


def install_docs_plugin(workdir: str) -> str:
    """Write the docs' plugin files under workdir and run the docs' `pip install ...` line there, into
    workdir/site (PIP_TARGET; PIP_NO_DEPS keeps it offline); once per process. Returns the site dir."""
    if "site" in _INSTALLED:
        return _INSTALLED["site"]
    blocks = doc_blocks()
    for b in blocks:
        if b.file:
            os.makedirs(os.path.join(workdir, os.path.dirname(b.file)), exist_ok=True)
            with open(os.path.join(workdir, b.file), "w") as f:
                f.write(b.code)
    [pip] = [argv for b in blocks if b.lang == "bash" for argv in bash_commands(b) if argv[0] == "pip"]
    site = os.path.join(workdir, "site")
    env = dict(os.environ, PIP_TARGET=site, PIP_NO_DEPS="1", PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    res = subprocess.run([PIP, *pip[1:]], cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    _INSTALLED.update(site=site, workdir=workdir, command=shlex.join(pip))
    return site


def installed_docs_plugin() -> dict[str, str]:
    return dict(_INSTALLED)
