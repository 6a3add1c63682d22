"""A Worker: one rank's compiled model, its KV cache, its graph dispatcher and its model runner, and nothing of
scheduling (vLLM's Worker). Tensor-parallel ranks, the engine core's rank 0, the draft-model proposer and `graphinfer
compile` each build one.

It is built in one fixed order:
  1. load     the weights and the fused graph (compiler/pipeline.py: the checkpoint through the passes, or an
              artifact's), over a 1-block placeholder KV cache; with speculative method "mtp" the checkpoint's MTP
              layer too (its cache rows are part of every block the budget counts)
  2. lower    the graph for the platform (Inductor, skinny GEMM, prepacked linears, bound op impls, torchair): the
              forward that will run, and its LM head; PIECEWISE modes: split at the splitting ops
  3. profile  that forward's activation peaks (GPUs: what gpu_memory_utilization leaves for the KV cache)
  4. allocate the KV cache, and point every graph's buffer reads at it (worker/model_runner.py)
  5. capture  warm the kernels, then record the mode's device graphs (worker/graph_dispatcher.py)
"""
import logging
from dataclasses import dataclass

import torch

from graphinfer.compiler.pipeline import CompilePipeline
from graphinfer.compiler.trace import rebind_buffers
from graphinfer.config import EngineConfig, SchedulerConfig, kv_cache_torch_dtype
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import InvalidConfigError
from graphinfer.models.layers import MLAAttention, activation_dtype, allocate_kv_cache
from graphinfer.platforms import KernelBackend, Platform
from graphinfer.runtime.engine.request import PromptLogprobs
from graphinfer.runtime.spec_decode.mtp_proposer import MTPProposer
from graphinfer.runtime.startup_timer import StartupTimer
from graphinfer.runtime.worker.graph_dispatcher import GraphDispatcher, resolve_graph_mode
from graphinfer.runtime.worker.inputs import HostInputs
from graphinfer.runtime.worker.model_runner import ModelRunner
from graphinfer.runtime.worker.sampler import SamplerOutput

logger = logging.getLogger(__name__)


@dataclass
class ModelOutput:
    """A launched step's sampled tokens: on the device, and their host copy, valid once `event` has completed (None:
    the work was done when the step returned, as on cpu). None fields: no row sampled. prompt_logprobs: the host copy
    of the step's prompt logprobs (ModelRunner.prompt_logprobs: logprobs, ranks, top-k ids, top-k logprobs), valid
    once `event` has completed too; None: the step had no prompt-logprob row."""
    sampled: SamplerOutput | None
    host: SamplerOutput | None
    event: object = None
    prompt_logprobs: tuple | None = None

    def wait(self) -> SamplerOutput | None:
        """The host copy, once it has landed."""
        if self.event is not None:
            self.event.synchronize()
        return self.host

    def wait_prompt_logprobs(self) -> PromptLogprobs | None:
        """The step's prompt logprobs on the host, once they have landed (None: the step computed none)."""
        if self.prompt_logprobs is None:
            return None
        if self.event is not None:
            self.event.synchronize()
        return PromptLogprobs(*(t.numpy() for t in self.prompt_logprobs))


class Worker:
    def __init__(self, config: EngineConfig, platform: Platform, backend: KernelBackend,
                 timer: StartupTimer | None = None):
        """config: the engine's (its compile_config.graph_mode is resolved here); backend: what platform.activate
        returned for config.compile_config.kernels."""
        self.config, self.platform = config, platform
        timer = timer or StartupTimer()
        mc, cc, spec = config.model_config, config.compile_config, config.speculative_config
        torch.manual_seed(mc.seed)
        device = torch.device(mc.device)
        if ps.is_initialized() and device.type != "cpu" and device.index is None:
            device = torch.device(device.type, ps.local_rank())  # one device per rank of this node
        self.device = device
        cc.graph_mode = resolve_graph_mode(config, platform, backend)  # what artifacts record and are checked against
        capture_sizes = cc.capture_sizes or platform.default_capture_sizes(cc.max_capture_size)
        self.num_speculative_tokens = spec.num_speculative_tokens if spec else None
        self.dispatcher = GraphDispatcher(config, platform, cc.graph_mode, capture_sizes, self.num_speculative_tokens,
                                          ps.tp_size())
        with ps.pipeline_local():  # pipeline parallel: until the capture, a stage's graph runs on its own
            self._build(config, platform, backend, device, capture_sizes, timer)
        self.dispatcher.capture(self.model_runner, self.compiled.split, timer.phase)  # 5. capture

    def _build(self, config: EngineConfig, platform: Platform, backend: KernelBackend, device: torch.device,
               capture_sizes: list[int], timer: StartupTimer) -> None:
        """Steps 1 to 4 (load, lower, profile, allocate) and the warm-up."""
        mc, spec = config.model_config, config.speculative_config
        memory_at_start = platform.memory_allocated(device)
        pipeline = CompilePipeline(config, platform, backend, device, capture_sizes, timer.phase)
        # kv_cache_dtype against the platform's kernels before the load (fail fast), against the model after it
        where = platform.name + (f" with kernels={backend.name!r}" if backend.name else "")
        kv_cache_torch_dtype(config.cache_config.kv_cache_dtype, mc.torch_dtype, where, backend.mixed_kv_cache)
        self.compiled = c = pipeline.load()  # 1. load
        drafter = None
        if spec is not None and spec.method == "mtp":  # the checkpoint's MTP layer: its cache counts in the budget
            with timer.phase("weights (MTP layer)"):
                drafter = MTPProposer.load(config, c.model, c.hf_config, device)
        self.max_model_len = max_model_len_of(c.hf_config, mc.max_model_len, config.scheduler_config)
        # the KV cache's dtype (kv_cache_dtype), refused here where the platform's ops or an MLA cache cannot take it
        mla = any(isinstance(m, MLAAttention) for m in c.model.modules())
        kv_dtype = kv_cache_torch_dtype(config.cache_config.kv_cache_dtype, activation_dtype(c.model), where,
                                        backend.mixed_kv_cache, mla)
        # a one-block KV cache in that dtype for lowering and profiling to run over (the real one is sized after)
        allocate_kv_cache(c.model, 1, config.cache_config.block_size, kv_dtype)
        rebind_buffers(c.model, c.graph)
        pipeline.lower(c)  # 2. lower
        if self.dispatcher.piecewise:
            pipeline.split(c)
        with timer.phase("KV cache"):  # 3. profile, 4. allocate
            self.model_runner = ModelRunner(c, config, device, platform, backend, self.dispatcher, self.max_model_len,
                                            platform.memory_allocated(device) - memory_at_start, drafter, kv_dtype)
        if device.type != "cpu":  # cpu: Inductor warmed itself, or there is nothing to compile
            with timer.phase("kernels"):  # compiles (or loads from the kernel cache) the prefill path's kernels
                self.model_runner.warm_up(speculative=self.num_speculative_tokens is not None)

    # ----- what the engine reads -----
    @property
    def num_blocks(self) -> int:
        return self.model_runner.num_blocks

    @property
    def hf_config(self):
        return self.compiled.hf_config

    @property
    def model(self):
        return self.compiled.model

    @property
    def graph(self):
        """The fused forward, as artifacts save it (the runner runs compiled.executable)."""
        return self.compiled.graph

    # ----- a step -----
    def execute(self, h: HostInputs, prev_tokens: torch.Tensor | None = None, mask_logits=None) -> ModelOutput:
        """Run the step h and sample; nothing here waits for the device. prev_tokens: the in-flight step's sampled
        ids (async scheduling); mask_logits: structured outputs' hook (ModelRunner.execute)."""
        sampled = self.model_runner.execute(h, prev_tokens, mask_logits)
        return self._output(sampled, self.model_runner.take_prompt_logprobs())

    def _output(self, sampled, plp) -> ModelOutput:
        """The step's ModelOutput: its host copies on their way (nothing waits for the device)."""
        if sampled is None and plp is None:
            return ModelOutput(None, None)
        if self.device.type == "cpu":
            return ModelOutput(sampled, sampled, prompt_logprobs=plp)
        host = sampled.to_host(non_blocking=True) if sampled is not None else None
        if plp is not None:
            plp = tuple(t.to("cpu", non_blocking=True) for t in plp)
        return ModelOutput(sampled, host, self.platform.record_event(self.device), plp)

    # ----- pipeline parallel (worker/pipeline_stage.py) -----
    def stage_step(self, h: HostInputs) -> None:
        """This stage's part of step h: its forward, the hidden state on to the next stage (the last: its sampling
        rows back to the first)."""
        self.model_runner.pipeline.timed(self.model_runner.step_logits, h)

    def pipeline_logits(self, rows: int) -> None:
        """First stage's TP ranks other than 0: the LM head of the step rank 0 lands (its all-gather pairs)."""
        self.model_runner.pipeline.timed(self.model_runner.pipeline_logits, rows)

    def land(self, h: HostInputs, mask_logits=None) -> ModelOutput:
        """Rank 0: step h's sampled tokens, from the last stage's final hidden rows (the LM head and the sampler run
        here, where the scheduler and every request's sampling state live)."""
        runner = self.model_runner
        return self._output(runner.pipeline.timed(
            lambda: runner.sample(h, runner.pipeline_logits(len(h.logits_indices)), mask_logits)), None)

    def pipeline_busy(self) -> list[float]:
        """Every rank of the replica's busy seconds so far, in rank order (each rank runs this: a gather)."""
        return ps.all_gather_object(self.model_runner.pipeline.busy_s)

    def save_rank_files(self, out_dir: str) -> dict | None:
        """This rank's part of a `graphinfer compile` artifact (compiler/artifact_export.py); rank 0: every stage's
        fused projections."""
        from graphinfer.compiler.artifact_export import write_rank_files

        return write_rank_files(out_dir, self.compiled)

    def release(self, tensors: bool = False) -> None:
        """Free the graphs, their pool, the static buffers and the KV cache; tensors: the weights too (also those of
        modules something else still refers to). The compiled graph and model stay readable (their weights go with
        the last reference to them). Idempotent."""
        runner, self.model_runner = getattr(self, "model_runner", None), None
        if runner is not None:
            runner.release()
        if getattr(self, "compiled", None) is not None:
            self.compiled.release(tensors)


def max_model_len_of(hf_config, requested: int | None, sc: SchedulerConfig) -> int:
    """The context a request may fill: max_model_len if given (refused past the model's), else the model's; one
    the scheduler could not fit in a step without chunked prefill is refused."""
    model_len = getattr(hf_config, "max_position_embeddings", None) or 2048
    if requested is not None and requested > model_len:
        raise InvalidConfigError(f"max_model_len={requested} exceeds the model's context length {model_len}; "
                                 f"use max_model_len <= {model_len}.")
    max_model_len = model_len if requested is None else requested
    if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < max_model_len:
        raise InvalidConfigError(
            f"max_num_batched_tokens={sc.max_num_batched_tokens} < max_model_len={max_model_len} "
            f"without chunked prefill: long prompts could never be scheduled. Raise max_num_batched_tokens, "
            f"lower max_model_len, or enable_chunked_prefill=True.")
    return max_model_len
