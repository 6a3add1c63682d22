"""Engine settings written once (EngineConfig's fields -> LLM kwargs and CLI flags), GRAPHINFER_* variables read in
graphinfer/envs.py only, docs/configuration.md generated from both, and gpu_memory_utilization's arithmetic."""
import argparse
import ast
import os
import pathlib

import pytest
import torch

from graphinfer import LLM, envs
from graphinfer import engine_args as ea
from graphinfer.cli import BENCH_DEFAULTS, build_parser
from graphinfer.config import CacheConfig, EngineConfig, derived_max_capture_size
from graphinfer.errors import InvalidConfigError, KVCacheTooSmallError

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "graphinfer"


def _subparser(*path) -> argparse.ArgumentParser:
    p = build_parser()
    for name in path:
        p = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices[name]
    return p


def _engine_actions(parser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.dest in ea.engine_args() and a.help != argparse.SUPPRESS}


# --- one place per default ----------------------------------------------------------------------------------------

def test_every_engine_setting_is_an_llm_kwarg_and_a_cli_flag():
    """generate takes every engine setting, serve every one but model / artifact (its positional target), each flag
    the field's name with dashes; the fields that are not engine arguments are listed with a reason."""
    fields = {f for cls in (*ea.SECTIONS.values(), EngineConfig) for f in cls.__dataclass_fields__} - set(ea.SECTIONS)
    assert set(ea.engine_args()) | set(ea.NOT_ARGUMENTS) == fields
    assert all(len(why) > 20 for why in ea.NOT_ARGUMENTS.values())
    generate, serve = _engine_actions(_subparser("generate")), _engine_actions(_subparser("serve"))
    assert set(generate) == set(ea.engine_args())
    assert set(serve) == set(ea.engine_args()) - {"model", "artifact"}
    for name, action in generate.items():
        assert "--" + name.replace("_", "-") in action.option_strings
        assert action.help and ea.engine_args()[name].help
    config = ea.create_engine_config({"model": "tiny-llama", "device": "cpu"})  # every name reaches the config
    assert all(ea.engine_args()[n].section is None or hasattr(getattr(config, ea.engine_args()[n].section), n)
               for n in ea.engine_args())


def test_cli_defaults_are_the_fields_defaults():
    """By construction: every engine flag of generate / serve / compile starts at the field's default (serve's step
    budget None: derived per platform at start); the benchmarks differ only where BENCH_DEFAULTS says."""
    for path in (("generate",), ("serve",), ("compile",)):
        for name, action in _engine_actions(_subparser(*path)).items():
            expected = None if path == ("serve",) and name == "max_num_batched_tokens" else ea.default(name)
            assert action.default == expected, (path, name, action.default)
    for path in (("bench", "throughput"), ("bench", "latency"), ("bench", "moe-balance")):
        for name, action in _engine_actions(_subparser(*path)).items():
            if name in BENCH_DEFAULTS and not (path[1] == "moe-balance" and name == "model"):
                assert action.default == BENCH_DEFAULTS[name] != ea.default(name)
            elif name != "model":
                assert action.default == ea.default(name), (path, name)
    booleans = [n for n, a in ea.engine_args().items() if ea._cli_type(a) is None]
    assert {"enable_prefix_caching", "capture_lm_head", "async_scheduling"} <= set(booleans)


def test_no_engine_default_is_written_twice():
    """cli.py and llm.py hold no literal default of an engine setting (a flag's default= or a parameter's) equal to
    the field's; server/defaults.py none either. None (not given / derive) is allowed."""
    names = set(ea.engine_args())
    for path in ("cli.py", "runtime/entrypoints/llm.py", "server/defaults.py", "server/serve.py"):
        tree = ast.parse((PACKAGE / path).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
                flags = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
                kw = {k.arg: k.value for k in node.keywords}
                dest = kw["dest"].value if "dest" in kw else max(flags, key=len).lstrip("-").replace("-", "_")
                if dest in names and isinstance(kw.get("default"), ast.Constant) and kw["default"].value is not None:
                    pytest.fail(f"{path}:{node.lineno}: {dest}'s default {kw['default'].value!r} written again: "
                                f"use the field's (engine_args.add_cli_args / engine_args.default)")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                pairs = [*zip(a.args[len(a.args) - len(a.defaults):], a.defaults), *zip(a.kwonlyargs, a.kw_defaults)]
                for arg, d in pairs:
                    if arg.arg in names and isinstance(d, ast.Constant) and d.value is not None:
                        pytest.fail(f"{path}:{node.lineno}: {node.name}({arg.arg}={d.value!r}) repeats a default")
            if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "get" and len(node.args) == 2:
                key, d = node.args
                if isinstance(key, ast.Constant) and key.value in names and isinstance(d, ast.Constant):
                    pytest.fail(f"{path}:{node.lineno}: .get({key.value!r}, {d.value!r}) repeats a default")
    # and the derived rule is written once
    hits = [p for p in PACKAGE.rglob("*.py") if "2 * max_num_seqs, 512" in p.read_text() and p.name != "config.py"]
    assert hits == []
    assert derived_max_capture_size(8) == 16 and derived_max_capture_size(300) == 512


def test_llm_kwargs_unknown_name_names_the_close_match():
    with pytest.raises(ea.UnknownEngineArgumentError, match="'max_num_seq'.*Did you mean 'max_num_seqs'"):
        LLM("tiny-llama", max_num_seq=4)
    with pytest.raises(TypeError, match="gpu_memory_utilisation.*'gpu_memory_utilization'"):
        LLM("tiny-llama", gpu_memory_utilisation=0.5)
    with pytest.raises(InvalidConfigError, match="data_parallel_rank"):  # set by graphinfer itself, not an argument
        ea.create_engine_config({"data_parallel_rank": 1})


def test_flat_kwargs_build_the_sections():
    c = EngineConfig.from_kwargs(model="tiny-llama", device="cpu", max_num_seqs=8, block_size=8,
                                 enable_prefix_caching=False, graph_mode="NONE", tensor_parallel_size=None,
                                 speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    assert (c.scheduler_config.max_num_seqs, c.cache_config.block_size, c.cache_config.enable_prefix_caching) == \
        (8, 8, False)
    assert c.compile_config.max_capture_size == 16  # derived: min(2 * 8, 512)
    assert c.parallel_config.tensor_parallel_size == 1 and c.parallel_config.enable_expert_parallel is False
    assert c.speculative_config.num_speculative_tokens == 2
    assert ea.create_engine_config({"model": "tiny-llama", "device": "cpu", "max_capture_size": 4}) \
        .compile_config.max_capture_size == 4


def test_block_size_defaults_to_the_platforms():
    """Unset, the KV block size is the device's platform's (vLLM-CPU: 128; ours 64, docs/benchmarks.md), else 16."""
    from graphinfer.platforms import platform_for_device

    assert EngineConfig.from_kwargs(model="tiny-llama", device="cpu").cache_config.block_size == 64
    assert platform_for_device("cuda").default_block_size == 16
    assert EngineConfig.from_kwargs(model="tiny-llama", device="cpu", block_size=16).cache_config.block_size == 16


def test_old_flag_spellings_still_parse():
    p = build_parser()
    a = p.parse_args(["bench", "throughput", "--no-prefix-caching", "--capture-sizes", "1,2,4", "-tp", "2"])
    assert (a.enable_prefix_caching, a.capture_sizes, a.tensor_parallel_size) == (False, [1, 2, 4], 2)
    a = p.parse_args(["serve", "--npu-kernels", "torch_npu", "--no-enable-prefix-caching", "--no-capture-lm-head",
                      "-q", "none", "--enable-expert-parallel", "-dp", "2"])
    assert (a.kernels, a.enable_prefix_caching, a.capture_lm_head, a.quantization) == ("torch_npu", False, False, None)
    assert (a.enable_expert_parallel, a.data_parallel_size) == (True, 2)
    a = p.parse_args(["generate", "--prompt", "x", "--speculative-config", '{"method": "ngram"}', "--splitting-ops",
                      "graphinfer::paged_attention", "--enable-prefix-caching"])
    assert a.speculative_config == {"method": "ngram"} and a.splitting_ops == ["graphinfer::paged_attention"]
    help_text = _subparser("serve").format_help()
    assert "--no-prefix-caching" not in help_text and "--no-enable-prefix-caching" in help_text


# --- environment variables ----------------------------------------------------------------------------------------

def _env_reads(tree: ast.Module) -> list[tuple[int, str]]:
    """(line, name) of each os.environ.get / os.getenv / os.environ[...] / `in os.environ` of a GRAPHINFER_ name,
    literal or through a module constant."""
    consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign) and isinstance(n.value, ast.Constant)
              for t in n.targets if isinstance(t, ast.Name)}

    def name_of(node):
        value = node.value if isinstance(node, ast.Constant) else consts.get(getattr(node, "id", None))
        return value if isinstance(value, str) and value.startswith("GRAPHINFER_") else None

    def is_environ(node):
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and (
                (isinstance(node.func, ast.Attribute) and node.func.attr in ("get", "pop", "setdefault")
                 and is_environ(node.func.value)) or getattr(node.func, "attr", None) == "getenv"):
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Compare) and any(is_environ(c) for c in node.comparators):
            key = node.left
        else:
            continue
        if (name := name_of(key)) is not None:
            out.append((node.lineno, name))
    return out


def test_graphinfer_variables_are_read_in_envs_only():
    offenders = [f"{p.relative_to(ROOT)}:{line}: {name}" for p in PACKAGE.rglob("*.py") if p.name != "envs.py"
                 for line, name in _env_reads(ast.parse(p.read_text()))]
    assert offenders == [], "read GRAPHINFER_* variables through graphinfer.envs:\n" + "\n".join(offenders)
    # and every GRAPHINFER_ name the package mentions is one envs.py documents
    import re

    named = {m for p in PACKAGE.rglob("*.py") for m in re.findall(r"\bGRAPHINFER_[A-Z_]+\b", p.read_text())}
    assert named <= set(envs.VARIABLES), named - set(envs.VARIABLES)
    assert _env_reads(ast.parse('import os\nX = "GRAPHINFER_A"\nos.environ.get(X)\nos.getenv("GRAPHINFER_B")\n'
                                '"GRAPHINFER_C" in os.environ\n')) == \
        [(3, "GRAPHINFER_A"), (4, "GRAPHINFER_B"), (5, "GRAPHINFER_C")]


def test_envs_read_lazily_with_defaults(monkeypatch):
    monkeypatch.delenv("GRAPHINFER_LOG_LEVEL", raising=False)
    assert envs.GRAPHINFER_LOG_LEVEL == "INFO"
    monkeypatch.setenv("GRAPHINFER_LOG_LEVEL", "DEBUG")
    assert envs.GRAPHINFER_LOG_LEVEL == "DEBUG" and envs.get("GRAPHINFER_LOG_LEVEL") == "DEBUG"
    monkeypatch.delenv("GRAPHINFER_CACHE_DIR", raising=False)
    assert envs.GRAPHINFER_CACHE_DIR == os.path.join(os.path.expanduser("~"), ".cache", "graphinfer")
    monkeypatch.delenv("GRAPHINFER_PLATFORM", raising=False)
    assert envs.GRAPHINFER_PLATFORM is None
    with pytest.raises(AttributeError):
        envs.GRAPHINFER_NOT_A_VARIABLE
    with pytest.raises(KeyError):
        envs.get("GRAPHINFER_NOT_A_VARIABLE")
    for var in envs.VARIABLES.values():
        assert var.setting is None or var.setting in ea.engine_args()


def test_configuration_md_is_generated_from_the_code():
    text = (ROOT / "docs" / "configuration.md").read_text()
    begin, end = text.index(ea.BEGIN), text.index(ea.END) + len(ea.END)
    assert text[begin:end] == ea.markdown(), "docs/configuration.md is stale: python -m graphinfer.engine_args"
    for name in envs.VARIABLES:
        assert f"`{name}`" in text


# --- gpu_memory_utilization ---------------------------------------------------------------------------------------

class _FakeGpu:
    """A platform stub for the arithmetic: a 80 GiB device with 70 GiB free, 1 GiB cached unused."""
    GiB = 1 << 30

    def mem_get_info(self, device):
        return 70 * self.GiB, 80 * self.GiB

    def memory_reserved(self, device):
        return 3 * self.GiB

    def memory_allocated(self, device):
        return 2 * self.GiB


def test_kv_cache_budget_is_vllms_fraction_of_total_memory():
    from graphinfer.runtime.worker.model_runner import kv_cache_budget

    G = 1 << 30
    # 0.9 of 80 GiB = 72 GiB, less 2 GiB held, 3 GiB of step activations, 1 GiB of graphs: 66 GiB, no hidden factor
    assert kv_cache_budget(0.9, 70 * G, 80 * G, G, 2 * G, 3 * G, G) == 66 * G
    # two engines at 0.4: each gets 0.4 of the total, less its own
    assert kv_cache_budget(0.4, 70 * G, 80 * G, 0, 2 * G, G, 0) == 29 * G
    # another process holds most of the device: what is free (plus the allocator's unused cache) bounds it
    assert kv_cache_budget(0.9, 10 * G, 80 * G, G, 2 * G, 3 * G, G) == 7 * G


def test_num_kv_blocks_on_a_gpu_uses_the_profiled_peaks():
    """The runner's sizing with a fake device: the blocks are what kv_cache_budget leaves, and a budget too small for
    one request names the profiled numbers and the knobs."""
    from graphinfer.runtime.worker.model_runner import ModelRunner

    G = 1 << 30
    runner = object.__new__(ModelRunner)
    runner.device, runner.platform, runner.block_size = torch.device("cuda"), _FakeGpu(), 16
    runner._block_bytes = lambda: 1 << 20  # 1 MiB a block
    runner._profile_peaks = lambda: (3 * G, G)
    cfg = CacheConfig(gpu_memory_utilization=0.9)
    assert runner._num_kv_blocks(cfg, 1024, 2 * G) == 66 * 1024  # (72 - 2 - 3 - 1) GiB of 1 MiB blocks
    assert runner._num_kv_blocks(CacheConfig(gpu_memory_utilization=0.5), 1024, 2 * G) == 34 * 1024
    with pytest.raises(KVCacheTooSmallError, match=r"(?s)gpu_memory_utilization=0.06 of 80.0 GiB.*engine's 2.00 GiB.*"
                                                   r"activations 3.00 GiB.*graph 1.00 GiB.*--gpu-memory-utilization"):
        runner._num_kv_blocks(CacheConfig(gpu_memory_utilization=0.06), 1024, 2 * G)
    assert runner._num_kv_blocks(CacheConfig(kv_cache_memory_bytes=G), 1024, 2 * G) == 1024  # given: no profiling


def test_profile_peaks_runs_a_full_step_shape(monkeypatch):
    """_profile_peaks' dummy steps (here on cpu, the peak read from a stub): requests of at most max_model_len tokens
    through the forward that runs (the lowered executable, not the fused graph), writing no KV: greedy output is
    unchanged afterwards."""
    from graphinfer import SamplingParams

    llm = LLM("tiny-llama", dtype="float32", num_gpu_blocks_override=16, max_num_seqs=4)
    greedy = SamplingParams(temperature=0, max_tokens=6)
    before = llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids
    runner = llm.llm_engine.worker.model_runner
    assert runner.graph is llm.llm_engine.worker.compiled.executable
    shapes = []
    real = runner._dummy_step
    monkeypatch.setattr(runner, "_dummy_step", lambda t, m, r: (shapes.append((t, m, r)), real(t, m, r)))
    runner.profile = dict(step_tokens=100, logits_rows=4, graph_tokens=8, max_model_len=48)
    assert runner._profile_peaks() == (0, 0)  # cpu: the platform keeps no allocator statistics
    assert shapes == [(100, 48, 4), (8, 48, 4)]
    assert llm.generate([[1, 2, 3]], greedy, use_tqdm=False)[0].outputs[0].token_ids == before
