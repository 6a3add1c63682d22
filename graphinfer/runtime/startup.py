"""An engine's start-up on the model side, in the order it must run: the device; the compile pipeline's weights and
fused graph (from an artifact, the tokenizer loads meanwhile in a thread); the model runner, whose KV cache is sized
from the memory those took (cpu: a thread starts committing its pages); then lowering, warm-up and capture over that
runner (compiler/pipeline.py)."""
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import torch

from graphinfer.compiler import artifact
from graphinfer.compiler.pipeline import CompiledModel, CompilePipeline
from graphinfer.config import EngineConfig
from graphinfer.distributed import parallel_state as ps
from graphinfer.models.layers import rope_parameters
from graphinfer.models.loader import load_tokenizer
from graphinfer.platforms import Platform
from graphinfer.runtime.input_processor import eos_token_ids_of, max_model_len_of
from graphinfer.runtime.model_runner import ModelRunner
from graphinfer.runtime.startup_timer import StartupTimer


class StartedModel(NamedTuple):
    device: torch.device
    compiled: CompiledModel
    tokenizer: object  # None on tensor-parallel ranks > 0 (they neither tokenize nor detokenize) and without one
    max_model_len: int
    eos_token_ids: set[int]
    runner: ModelRunner


def start_model(config: EngineConfig, platform: Platform, timer: StartupTimer, channel=None) -> StartedModel:
    """channel: tensor parallel, on rank 0: the StepChannel to the other ranks (runtime/executor.py)."""
    mc, spec = config.model_config, config.speculative_config
    torch.manual_seed(mc.seed)
    device = torch.device(mc.device)
    if ps.is_initialized() and device.type != "cpu" and device.index is None:
        device = torch.device(device.type, ps.local_rank())  # one device per rank of this node
    memory_at_start = platform.memory_allocated(device)
    pipeline = CompilePipeline(config, platform, device, timer.phase)
    # From an artifact, the tokenizer (mostly transformers' import) loads in a thread while the weights and graph
    # load, where nothing else imports transformers meanwhile (its lazy module is not safe to import from two
    # threads at once; RoPE other than "default" uses transformers' init functions).
    in_thread = pipeline.manifest is not None and ps.tp_rank() == 0 and \
        rope_parameters(artifact.load_config(config.artifact)).get("rope_type", "default") == "default"
    with ThreadPoolExecutor(1) as pool:
        pending = pool.submit(_load_tokenizer, config, timer, "tokenizer (in a thread)") if in_thread else None
        compiled = pipeline.load()
        if pending is not None:
            with timer.phase("tokenizer (wait for its thread)"):
                tokenizer = pending.result()
        else:
            tokenizer = _load_tokenizer(config, timer, "tokenizer") if ps.tp_rank() == 0 else None
    max_model_len = max_model_len_of(compiled.hf_config, mc.max_model_len, config.scheduler_config)
    eos_token_ids = eos_token_ids_of(compiled.hf_config, tokenizer)
    with timer.phase("KV cache"):
        engine_bytes = platform.memory_allocated(device) - memory_at_start
        sc, graphs = config.scheduler_config, config.compile_config.graph_mode != "NONE"
        runner = ModelRunner(compiled.model, config.cache_config, device, platform, eos_token_ids, mc.seed,
                             max_model_len, engine_bytes, placeholder_kv=config.compile_only, graph=compiled.graph,
                             step_tokens=sc.max_num_batched_tokens, logits_rows=sc.max_num_seqs,
                             graph_tokens=max(compiled.capture_sizes) if graphs else 0,
                             logprobs_mode=mc.logprobs_mode)
        if not config.compile_only:
            runner.kv_pages = platform.populate_in_background(runner.kv_cache)
    runner.channel = channel
    pipeline.finish(compiled, runner, max_model_len, spec.num_speculative_tokens if spec else None)
    return StartedModel(device, compiled, tokenizer, max_model_len, eos_token_ids, runner)


def _load_tokenizer(config: EngineConfig, timer: StartupTimer, phase: str):
    with timer.phase(phase):
        if config.artifact:
            return artifact.load_tokenizer(config.artifact)
        return load_tokenizer(config.model_config.model)
