"""The offline API, shaped like vLLM's: LLM(model=...).generate(prompts, sampling_params)."""
from collections.abc import Sequence as Seq
from dataclasses import replace

from tqdm.auto import tqdm

from graphinfer.engine_args import create_engine_config
from graphinfer.errors import GraphinferError, InvalidConfigError
from graphinfer.outputs import RequestOutput
from graphinfer.runtime.entrypoints.chat_template import chat_prompt_ids
from graphinfer.runtime.entrypoints.llm_engine import LLMEngine
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
    default: the platform's, FULL_AND_PIECEWISE on cuda / npu, FULL_DECODE_ONLY on cpu with its eager kernels):
    "NONE" runs every step eagerly;
    "FULL_DECODE_ONLY" captures one device graph of the whole forward per decode batch size in `capture_sizes`
    (LM head inside unless capture_lm_head=False) and replays it for uniform decode steps; "PIECEWISE" splits
    the graph at attention (`splitting_ops`) and captures the pieces per token count, so any step up to the
    largest size replays them with attention run eagerly in between; "FULL_AND_PIECEWISE" does both. Capture
    sizes default to vLLM's list up to max_capture_size (config.derived_max_capture_size: twice max_num_seqs, at
    most 512); on cpu, whose "graphs" are traces of the decode forward (NONE and FULL_DECODE_ONLY only), 1, 2, 4, 8.
    kernels: the platform's op implementations (None: its default; "reference": PyTorch).
    npu_compiler="torchair": torchair compiles the fused graph and captures ACL graphs (npu, graph_mode NONE).
    async_scheduling: prepare and launch each step while the previous one runs (see engine/core.py).
    tensor_parallel_size: shard the model over that many ranks (devices; on cpu, processes sharing the cores) with
    torch.distributed (gloo on cpu, NCCL on cuda, HCCL on npu); graphinfer starts the other ranks of this node.
    Default: the artifact's (an artifact runs only at the size it was compiled for), else 1.
    enable_expert_parallel: MoE models partition whole experts over the ranks (expert parallel, EP size =
    tensor_parallel_size x data_parallel_size) instead of splitting every expert; dense models are unaffected.
    Default: the artifact's, else False.
    data_parallel_size: that many engine replicas (each tensor_parallel_size ranks, its own scheduler and KV
    cache; replica 0 in this process), each request on the replica with the fewest outstanding tokens
    (runtime/engine/dp_core.py). MoE + expert parallel replicas step in lockstep. With data_parallel_size_local <
    data_parallel_size (and data_parallel_address, data_parallel_rpc_port) this process is node 0 and the other
    replicas run on `graphinfer serve --headless --data-parallel-start-rank R ...` nodes.
    Tensor parallel across nodes (nnodes > 1, node_rank, master_addr, master_port: vLLM's / torchrun's names): this
    process is node 0; the other nodes run `graphinfer serve|generate ... --node-rank N` with the same arguments.
    speculative_config: vLLM's dict, e.g. {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4},
    {"model": DRAFT, "num_speculative_tokens": 3} or, for a DeepSeek-V3 checkpoint with MTP layers, {"method": "mtp",
    "num_speculative_tokens": 1} (config.SpeculativeConfig); greedy outputs are those without it,
    sampled ones follow the same distribution.
    gpu_memory_utilization: the fraction of the device's total memory this engine may use (weights, the profiled
    activation peak of a step, graphs and KV cache; as in vLLM, so two engines at 0.4 fit on one device). A KV cache
    that cannot hold one request of max_model_len tokens is refused at start-up (KVCacheTooSmallError).
    Every keyword argument and its default: docs/configuration.md (EngineConfig's fields).
    shutdown() (or `with LLM(...) as llm:`, or dropping the last reference) gives the memory back.
    """

    def __init__(self, model: str | None = None, **kwargs):
        """kwargs: the engine settings, EngineConfig's fields by name (graphinfer/config.py; defaults there and
        nowhere else); another name raises UnknownEngineArgumentError (a TypeError) naming the close matches."""
        if model is not None:
            kwargs["model"] = model
        self.llm_engine = LLMEngine(create_engine_config(kwargs))
        # cpu: the KV cache's pages are committed by a background thread from start-up on; the first generate would
        # wait for it (its time counted in the first batch): wait here, so LLM() returns with them committed.
        self.llm_engine.wait_for_kv_cache_pages()

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
                 use_tqdm: bool = True, lora_request=None) -> list[RequestOutput]:
        """prompts: a string, a list of strings, a list of token ids, a list of token-id lists, or
        vLLM-style dicts ({"prompt": ...} / {"prompt_token_ids": [...]}). Outputs come in prompt order.
        lora_request: a LoRARequest (graphinfer.lora) for every prompt, or a list with one (or None) per prompt
        (needs enable_lora=True)."""
        if not self.llm_engine.is_running:
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
        loras = lora_request if isinstance(lora_request, (list, tuple)) else [lora_request] * len(prompts)
        if len(loras) != len(prompts):
            raise InvalidConfigError(f"Got {len(prompts)} prompts but {len(loras)} LoRA requests; pass one "
                                     f"LoRARequest or one (or None) per prompt.")
        return self._run([self.llm_engine.make_request(p, sp, lora_request=lr)
                          for p, sp, lr in zip(prompts, params, loras)], use_tqdm)

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, chat_template: str | None = None,
             tools: list[dict] | None = None, chat_template_kwargs: dict | None = None, lora_request=None):
        """messages: one conversation (a list of {"role", "content"} dicts; assistant messages may carry
        "tool_calls", tool results come as {"role": "tool", "tool_call_id", "content"}) or a list of them.
        tools: OpenAI's [{"type": "function", "function": {"name", "description", "parameters"}}], rendered by
        chat templates that have a tools block (Qwen, Llama 3.x), as in vLLM's LLM.chat. chat_template_kwargs: more
        variables the template reads (e.g. enable_thinking for Qwen3)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [{"prompt_token_ids": chat_prompt_ids(self.get_tokenizer(), conv, add_generation_prompt, chat_template,
                                                        tools, chat_template_kwargs)} for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm, lora_request)

    def _run(self, requests, use_tqdm: bool) -> list[RequestOutput]:
        # Every prompt was validated before any was queued: a bad one leaves nothing behind.
        engine = self.llm_engine
        engine.wait_for_kv_cache_pages()
        finished: dict[str, RequestOutput] = {}
        try:
            for req in requests:
                engine.add(req)
            with tqdm(total=len(requests), desc="Processed prompts", disable=not use_tqdm) as bar:
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if out.finished:
                            finished[out.request_id] = out
                            bar.update(1)
        finally:  # an exception or Ctrl-C mid-run must not leak KV blocks
            if engine.is_running:
                engine.abort_requests([req.request_id for req in requests])
        return [finished[req.request_id] for req in requests]


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):  # one prompt as token ids
        return [prompts]
    if not all(isinstance(p, (str, dict, Seq)) for p in prompts):
        raise InvalidConfigError("prompts must be a string, token ids, or a list of those.")
    return prompts
