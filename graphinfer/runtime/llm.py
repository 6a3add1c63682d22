"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, sampling_params)."""
from collections.abc import Sequence as Seq
from dataclasses import replace

from tqdm.auto import tqdm

from graphinfer.compiler import artifact as artifacts
from graphinfer.config import (CacheConfig, CompileConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig,
                               SpeculativeConfig)
from graphinfer.errors import GraphinferError, InvalidConfigError
from graphinfer.outputs import RequestOutput
from graphinfer.runtime.chat_template import chat_prompt_ids
from graphinfer.runtime.dp_engine import DPEngine
from graphinfer.runtime.llm_engine import LLMEngine
from graphinfer.sampling_params import RequestOutputKind, SamplingParams


class LLM:
    """Offline batched generation.

    model: an HF checkpoint directory (config.json + *.safetensors), a .gguf file or a named preset with
    random weights (graphinfer.models.presets); default: the bundled SmolLM2-135M-Instruct. Other arguments
    keep vLLM's names (dtype, max_model_len, block_size, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching, seed, ...). The model is traced and optimised by `passes` ("default", "none" or
    a list of names) at start-up, unless `artifact` names a `graphinfer compile` output to start from
    (its model, dtype, graph mode, capture sizes and tensor_parallel_size are then the defaults).

    device: "auto" picks the detected platform (cuda, npu, else cpu). graph_mode (vLLM's CUDAGraphMode names;
    default: the platform's, FULL_AND_PIECEWISE on cuda / npu and NONE on cpu): "NONE" runs every step eagerly;
    "FULL_DECODE_ONLY" captures one device graph of the whole forward per decode batch size in `capture_sizes`
    (LM head inside unless capture_lm_head=False) and replays it for uniform decode steps; "PIECEWISE" splits
    the graph at attention (`splitting_ops`) and captures the pieces per token count, so any step up to the
    largest size replays them with attention run eagerly in between; "FULL_AND_PIECEWISE" does both. Capture
    sizes default to vLLM's list up to max_capture_size (min(2 * max_num_seqs, 512)).
    kernels: the platform's op implementations (None: its default; "reference": PyTorch).
    npu_compiler="torchair": torchair compiles the fused graph and captures ACL graphs (npu, graph_mode NONE).
    async_scheduling: prepare and launch each step while the previous one runs (see LLMEngine).
    tensor_parallel_size: shard the model over that many ranks (devices; on cpu, processes sharing the cores) with
    torch.distributed (gloo on cpu, NCCL on cuda, HCCL on npu); graphinfer starts the other ranks of this node.
    Default: the artifact's (an artifact runs only at the size it was compiled for), else 1.
    enable_expert_parallel: MoE models partition whole experts over the ranks (expert parallel, EP size =
    tensor_parallel_size x data_parallel_size) instead of splitting every expert; dense models are unaffected.
    Default: the artifact's, else False.
    data_parallel_size: that many engine replicas (each tensor_parallel_size ranks, its own scheduler and KV
    cache; replica 0 in this process), each request on the replica with the fewest outstanding tokens
    (runtime/dp_engine.py). MoE + expert parallel replicas step in lockstep. One node only.
    Across nodes (nnodes > 1, node_rank, master_addr, master_port: vLLM's / torchrun's names) this process is
    node 0; the other nodes run `graphinfer serve|generate ... --node-rank N` with the same arguments.
    speculative_config: vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4} or
    {"model": DRAFT, "num_speculative_tokens": 3} (config.SpeculativeConfig); greedy outputs are those without it,
    sampled ones follow the same distribution.
    gpu_memory_utilization: the fraction of the device's total memory this engine may use (weights, graphs and
    KV cache; as in vLLM, so two engines at 0.4 fit on one device). A KV cache that cannot hold one request of
    max_model_len tokens is refused at start-up (KVCacheTooSmallError).
    shutdown() (or `with LLM(...) as llm:`, or dropping the last reference) gives the memory back.
    """

    def __init__(self, model: str = "", *, dtype: str = "auto", max_model_len: int | None = None,
                 block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 enable_prefix_caching: bool = True, enable_chunked_prefill: bool = True, async_scheduling: bool = False,
                 kv_cache_memory_bytes: int | None = None, gpu_memory_utilization: float = 0.9,
                 num_gpu_blocks_override: int | None = None, seed: int = 0, device: str = "auto",
                 passes: str | list[str] = "default", graph_mode: str | None = None, capture_sizes: list[int] | None = None,
                 capture_lm_head: bool = True, kernels: str | None = None, npu_compiler: str | None = None,
                 max_capture_size: int | None = None, splitting_ops: list[str] | None = None,
                 tensor_parallel_size: int | None = None, nnodes: int = 1, node_rank: int = 0,
                 master_addr: str = "127.0.0.1", master_port: int | None = None,
                 enable_expert_parallel: bool | None = None, data_parallel_size: int = 1,
                 quantization: str | None = None, speculative_config: dict | None = None,
                 artifact: str | None = None):
        if artifact:
            manifest = artifacts.read_manifest(artifact)
            model = model or manifest["model"]["path"]
            dtype = manifest["dtype"] if dtype == "auto" else dtype
            quantization = quantization or (manifest.get("quantization") or {}).get("method")
            graph_mode = graph_mode or manifest["graph_mode"]
            capture_sizes = capture_sizes or manifest["capture_sizes"]
            splitting_ops = splitting_ops or (manifest.get("split") or {}).get("splitting_ops")
            speculative_config = speculative_config or manifest.get("speculative_config")
            if tensor_parallel_size is None:
                tensor_parallel_size = artifacts.tensor_parallel_size(manifest)
            if enable_expert_parallel is None:
                enable_expert_parallel = artifacts.expert_parallel(manifest)
        if tensor_parallel_size is None:
            tensor_parallel_size = 1
        engine_cls = DPEngine if data_parallel_size > 1 else LLMEngine
        self.llm_engine = engine_cls(EngineConfig(
            ModelConfig(model, dtype, max_model_len, seed, device, quantization),
            CacheConfig(block_size, enable_prefix_caching, kv_cache_memory_bytes, gpu_memory_utilization,
                        num_gpu_blocks_override),
            SchedulerConfig(max_num_seqs, max_num_batched_tokens, enable_chunked_prefill, async_scheduling),
            CompileConfig(graph_mode, passes, capture_sizes, capture_lm_head, kernels, npu_compiler, max_capture_size,
                          splitting_ops),
            ParallelConfig(tensor_parallel_size, nnodes, node_rank, master_addr, master_port,
                           enable_expert_parallel=bool(enable_expert_parallel),
                           data_parallel_size=data_parallel_size),
            artifact=artifact, speculative_config=SpeculativeConfig.from_dict(speculative_config),
        ))

    def shutdown(self) -> None:
        """Release the engine's device memory now (graphs and their pool, KV cache, static buffers, weights).
        Also done by `with LLM(...) as llm:` on leaving the block, and when the last reference is dropped."""
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, a list of token-id lists, or
        vLLM-style dicts ({"prompt": ...} / {"prompt_token_ids": [...]}). Outputs come in prompt order."""
        if self.llm_engine.model_runner is None:
            raise GraphinferError("This LLM was shut down (shutdown(), or its `with` block ended): create a new one.")
        prompts = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise InvalidConfigError(f"Got {len(prompts)} prompts but {len(params)} SamplingParams; "
                                         f"pass one SamplingParams or one per prompt.")
        params = [replace(sp, output_kind=RequestOutputKind.FINAL_ONLY) for sp in params]  # only the ends are read
        return self._run([self.llm_engine.make_sequence(p, sp) for p, sp in zip(prompts, params)], use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: str | None = None,
             tools: list[dict] | None = None):
        """messages: one conversation (a list of {"role", "content"} dicts; assistant messages may carry
        "tool_calls", tool results come as {"role": "tool", "tool_call_id", "content"}) or a list of them.
        tools: OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}], rendered by
        chat templates that have a tools block (Qwen, Llama 3.x), as in vLLM's LLM.chat."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": chat_prompt_ids(self.get_tokenizer(), conv, add_generation_prompt, chat_template,
                                                        tools)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, seqs, use_tqdm: bool) -> list[RequestOutput]:
        # Every prompt was validated before any was queued: a bad one leaves nothing behind.
        engine = self.llm_engine
        for seq in seqs:
            engine.add_sequence(seq)
        finished: dict[str, RequestOutput] = {}
        try:
            with tqdm(total=len(seqs), desc="Processed prompts", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
        finally:  # an exception or Ctrl-C mid-run must not leak KV blocks
            for seq in seqs:
                engine.abort_request(seq.request_id)
        return [finished[seq.request_id] for seq in seqs]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):  # one prompt as token ids
        return [prompts]
    if not all(isinstance(p, (str, dict, Seq)) for p in prompts):
        raise InvalidConfigError("prompts must be a string, token ids, or a list of those.")
    return prompts
