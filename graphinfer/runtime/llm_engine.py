"""LLMEngine: requests in, one scheduled + executed + sampled step at a time, RequestOutputs out.

Start-up is the compile pipeline's (compiler/pipeline.py: weights and fused graph, lowering, split, capture) around
the model runner's KV cache; requests come in through runtime/input_processor.py and their tokens go out through
runtime/output_processor.py. What is left here is scheduling and stepping.

With async scheduling (vLLM's --async-scheduling) the host does not wait for a step's sampled tokens before
scheduling and launching the next: step N+1 is prepared and launched while step N runs on the device, its
input ids taken from step N's sampled tokens on the device, and step N's tokens are then appended, checked
for stops and returned while step N+1 runs. The price: a request that stops on a token (eos, stop ids or
strings) has computed one more row, which is dropped; requests that stop on length never do.
"""
import gc
import logging
import time
from dataclasses import dataclass

import torch

from graphinfer.compiler.artifact_export import export_artifact, write_rank_files
from graphinfer.config import EngineConfig
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import GraphinferError
from graphinfer.outputs import RequestOutput
from graphinfer.platforms import Platform, platform_for_device
from graphinfer.runtime import dp_lockstep
from graphinfer.runtime.executor import MultiprocExecutor
from graphinfer.runtime.expert_load import read_expert_load, reset_expert_load, summarize
from graphinfer.runtime.input_processor import InputProcessor
from graphinfer.runtime.output_processor import OutputProcessor
from graphinfer.runtime.parallel_layout import check_artifact_parallel, check_parallel_config, expert_parallel_size
from graphinfer.runtime.sampler import SamplerOutput
from graphinfer.runtime.scheduler import Scheduler, SchedulerOutput
from graphinfer.runtime.sequence import Sequence
from graphinfer.runtime.spec_decode import make_proposer
from graphinfer.runtime.startup import start_model
from graphinfer.runtime.startup_timer import StartupTimer, seconds_since_process_start
from graphinfer.runtime.structured_output import StructuredOutputManager
from graphinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are not yet read on the host (async scheduling)."""
    sched: SchedulerOutput
    rows: list[Sequence]  # the sequences that sample, row i of `sampled`
    sampled: SamplerOutput  # on the device: the next step's pending input ids come from here
    host: SamplerOutput  # its non-blocking host copy, valid once `event` has completed
    event: object  # None on cpu


def _compiled(field: str) -> property:
    """A field of what the compile pipeline built (CompiledModel; None once released)."""
    return property(lambda self: getattr(getattr(self, "compiled", None), field, None))


class LLMEngine:
    graph = _compiled("graph")  # the fused forward, as artifacts save it (the runner runs compiled.executable)
    pass_reports, split, skinny_gemm = _compiled("pass_reports"), _compiled("split"), _compiled("skinny_gemm")
    capture_sizes, capture_stats = _compiled("capture_sizes"), _compiled("capture_stats")
    piecewise_capture_stats = _compiled("piecewise_capture_stats")

    def __init__(self, config: EngineConfig, platform: Platform | None = None):
        """platform: the one to run on (a tensor-parallel worker gets rank 0's); None: the device's."""
        self.config = config
        self.executor = None  # tensor parallel, on rank 0: the other ranks (runtime/executor.py)
        self._is_worker = ps.is_initialized()  # a rank > 0: its group is this engine's to destroy on release
        # Platform first: activating it loads its torch backend (npu: torch_npu), so "npu" parses below even
        # with TORCH_DEVICE_BACKEND_AUTOLOAD=0.
        self.platform = platform or platform_for_device(str(config.model_config.device).split(":")[0])
        self.platform.activate(config.compile_config.kernels)
        if config.artifact:
            check_artifact_parallel(config)
        if config.parallel_config.world_size > 1 and not ps.is_initialized():
            check_parallel_config(config)
            self.executor = MultiprocExecutor(config, self.platform)
        try:
            self._build(config)
        except BaseException as e:
            if self.executor is not None:  # stop the other ranks; say why the group broke, if a rank died
                self.executor.shutdown()
                if self.executor.dead is not None and isinstance(e, ps.DistributedError):
                    raise ps.DistributedError(f"{self.executor.dead} while the engine started: {e}") from None
            raise

    def _build(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.startup = timer = StartupTimer()
        if (since_start := seconds_since_process_start()) is not None:
            timer.record("imports (process start to engine start)", since_start)
        channel = self.executor.channel if self.executor is not None and ps.tp_size() > 1 else None
        self.device, self.compiled, self.tokenizer, self.max_model_len, self.eos_token_ids, runner = \
            start_model(config, self.platform, timer, channel)
        self.model_runner, self.model, self.hf_config = runner, self.compiled.model, self.compiled.hf_config
        # MoE + expert parallel over several replicas: their MoE layers share all-to-alls, so they step together
        self.dp_lockstep = ps.dp_size() > 1 and ps.ep_size() > 1 and bool(runner.moe_layers)
        self.lockstep = dp_lockstep.Lockstep(self.dp_lockstep)
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, runner.num_blocks)
        self.proposer, self.spec_stats = make_proposer(config.speculative_config, self)
        # Speculative decoding steps synchronously: drafts for step N+1 need step N's accepted tokens on the host
        self.async_scheduling = config.scheduler_config.async_scheduling and self.proposer is None
        self._in_flight: _InFlight | None = None
        self._early_outputs: list[RequestOutput] = []  # the in-flight step's, finished early by _mask_logits
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids, self.device,
            self.platform.device_module if self.device.type != "cpu" else None)
        self.outputs = OutputProcessor(self.scheduler, self.structured_output, self.tokenizer, self.eos_token_ids,
                                       self.max_model_len)
        self.requests, self.parents = self.outputs.requests, self.outputs.parents  # what runs, by request id
        self.inputs = InputProcessor(config.model_config.model, self.tokenizer, self.hf_config.vocab_size,
                                     self.max_model_len, self.scheduler.block_manager, runner.num_blocks,
                                     self.structured_output, self.device, self.requests, self.parents)
        self.tokenize, self.make_sequence = self.inputs.tokenize, self.inputs.make_sequence
        self.reset_expert_load()  # warm-up, capture and the passes' checks ran the MoE layers on synthetic inputs
        timer.record("engine ready", time.perf_counter() - started)

    def spec_decode_stats(self) -> dict:
        """Speculative decoding's counters since start (SpecDecodingStats.as_dict), {} with it off."""
        return self.spec_stats.as_dict() if self.spec_stats is not None else {}

    def save_artifact(self, out_dir: str, **check) -> dict:
        """Write what this engine compiled as a `graphinfer compile` artifact (compiler/artifact_export.py; check:
        atol, rtol, allow_check_failure). The other tensor-parallel ranks write their shards meanwhile."""
        others = (lambda d: self.executor.channel.call("save_rank_files", d)) if self.executor is not None else None
        return export_artifact(out_dir, self.compiled, self.config, self.tokenizer, self.device, other_ranks=others,
                               **check)

    def save_rank_files(self, out_dir: str) -> None:  # a tensor-parallel rank's part, called by rank 0
        write_rank_files(out_dir, self.compiled)

    # ----- expert load (runtime/expert_load.py): tokens routed to each expert since ready or the last reset; {} for
    # a dense model; rank 0's are the totals under tensor parallelism. A host sync: call it between steps. -----
    expert_parallel_size = property(lambda self: expert_parallel_size(self.config))

    def expert_load(self) -> dict[int, list[int]]:
        return read_expert_load(self.model_runner.moe_layers) if getattr(self, "model_runner", None) else {}

    def expert_load_summary(self, ep_size: int | None = None) -> dict:
        """Tokens per EP rank and imbalances (max / mean) for ep_size (default: this engine's EP size)."""
        return summarize(self.expert_load(), ep_size or self.expert_parallel_size)

    def reset_expert_load(self) -> None:
        if getattr(self, "model_runner", None) is not None:
            reset_expert_load(self.model_runner.moe_layers)

    def shutdown(self) -> None:
        """Release every device buffer this engine holds: captured graphs and their pool, static buffers, the KV
        cache and the weights (also those of modules something else still refers to), then hand the freed memory
        back to the device. The engine cannot run afterwards."""
        compiled = getattr(self, "compiled", None)
        if not self._release():
            return
        if compiled is not None:
            compiled.release(tensors=True)
        del compiled
        gc.collect()
        self.platform.empty_cache()

    def _release(self) -> bool:
        """Free the graphs, static buffers and KV cache, and drop the engine's references (weights go with the last
        reference to them). False if already done."""
        if getattr(self, "executor", None) is not None:  # stop the other tensor-parallel ranks
            self.executor, executor = None, self.executor
            executor.shutdown()
        elif getattr(self, "_is_worker", False):  # a worker rank, told to stop by rank 0
            self._is_worker = False  # once: a later engine in this process may own a new group
            ps.destroy()
        runner, compiled = getattr(self, "model_runner", None), getattr(self, "compiled", None)
        if runner is None and compiled is None:  # released, or __init__ failed before loading anything
            return False
        if hasattr(getattr(self, "proposer", None), "shutdown"):  # a draft model's engine
            self.proposer.shutdown()
        self.proposer = None
        for request_id in [*getattr(self, "parents", ()), *getattr(self, "requests", ())]:
            self.abort_request(request_id)
        self._in_flight = None
        if runner is not None:
            runner.release()
        if compiled is not None:
            compiled.release()
        self.model_runner = self.compiled = self.model = None
        return True

    def __del__(self):
        # The last reference dropped: release without waiting for a garbage collection. (Cached device memory is
        # reused by the next engine in this process; shutdown() also hands it back to the device.)
        try:
            self._release()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass

    # ----- requests (in: tokenize, make_sequence: runtime/input_processor.py; out: runtime/output_processor.py) -----
    def add_sequence(self, seq: Sequence) -> None:
        for s in self.outputs.add_request(seq):
            self.scheduler.add(s)

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None) -> str:
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> None:
        """Abort a request (every child of a parallel-sampling one) and free its blocks."""
        self.outputs.abort_request(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def scheduler_stats(self) -> dict:
        return self.scheduler.stats()

    @property
    def dead(self) -> str | None:
        """Why the engine can no longer run (a tensor-parallel rank died), or None."""
        return self.executor.dead if self.executor is not None else None

    def on_death(self, callback) -> None:
        """callback(message) once a rank this engine needs dies."""
        if self.executor is not None:
            self.executor.death_listeners.append(callback)

    def wait_for_kv_cache_pages(self) -> None:
        """Join the thread committing the KV cache's pages (cpu: CpuPlatform.populate_in_background) if it still
        runs. The offline API does before its first step, so a batch job does not page-fault the cache in as it goes;
        the server does not wait (the thread runs in its idle time)."""
        runner = self.model_runner
        if runner is not None and runner.kv_pages is not None:
            runner.kv_pages.join()
            runner.kv_pages = None

    # ----- stepping -----
    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step. Returns an output for each request that got a token (with
        output_kind FINAL_ONLY: only once it finished), after which the engine forgets finished ones; a streamed
        n > 1 request gets one per child that got a token (runtime/parallel_sampling.py).
        With async scheduling, the tokens returned are the previous step's."""
        if self.async_scheduling:
            return self._step_async()
        if self.proposer is not None:
            # structured requests get no drafts: their mask is known for the next token only
            self.proposer.propose_for([s for s in self.scheduler.running
                                       if s.num_computed_tokens == s.num_tokens - 1 and s.grammar is None])
        sched = self._schedule()
        dp = self.lockstep.agree(sched)
        if not sched.scheduled:
            if dp is not None:  # another replica has work: run the padding its MoE all-to-alls pair with
                self.model_runner.execute_model(None, dp_step=dp)
            return []
        rows, sampled = self._execute(sched, dp_step=dp, mask_logits=self._mask_logits)
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n - len(seq.spec_token_ids)  # drafts count once accepted (_accept_drafts)
        if sampled is None:
            return []
        return self.outputs.process(rows, sampled.to_host(), self.spec_stats)

    def _step_async(self) -> list[RequestOutput]:
        outputs = []
        if self._in_flight is not None and any(s.sampling_params.has_penalties for s in self._in_flight.rows):
            outputs = self._finish_in_flight()  # penalties count output tokens: they must be on the host
        sched = self._schedule(in_flight=self._in_flight is not None)
        dp = self.lockstep.agree(sched)
        launched = None
        if not sched.scheduled and dp is not None:
            self.model_runner.execute_model(None, dp_step=dp)
        if sched.scheduled:
            prev = self._in_flight.sampled.sampled_token_ids if self._in_flight is not None else None
            rows, sampled = self._execute(sched, prev, share_sampled=True, dp_step=dp, mask_logits=self._mask_logits)
            outputs += self._early_outputs
            self._early_outputs = []
            for seq, n in sched.scheduled:
                seq.num_computed_tokens += n
            if sampled is not None:
                for i, seq in enumerate(rows):
                    seq.num_pending += 1
                    seq.pending_row = i
                launched = _InFlight(sched, rows, sampled, sampled.to_host(non_blocking=True),
                                     self.platform.record_event(self.device))
        outputs += self._finish_in_flight()
        self._in_flight = launched
        return outputs

    def _mask_logits(self, logits: torch.Tensor, rows: list[Sequence], spec_lens: list[int] | None) -> None:
        """The runner's hook between a step's forward (launched, still running on the device) and its sampling:
        structured outputs' grammar masks, filled on the host meanwhile. With async scheduling the in-flight step's
        tokens reach the matchers first (its outputs are returned with this step's)."""
        if self.structured_output.wants_mask(rows):
            self._early_outputs += self._finish_in_flight()
            self.structured_output.mask_logits(logits, rows, spec_lens)

    def _finish_in_flight(self) -> list[RequestOutput]:
        step, self._in_flight = self._in_flight, None
        if step is None:
            return []
        if step.event is not None:
            step.event.synchronize()
        for seq in step.rows:
            seq.num_pending -= 1
        return self.outputs.process(step.rows, step.host, self.spec_stats)

    def _schedule(self, in_flight: bool = False) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        if not sched.scheduled and not in_flight and self.scheduler.has_unfinished() and not sched.preempted:
            raise GraphinferError("Scheduler made no progress with requests pending; this is a bug.")
        return sched

    def _execute(self, sched: SchedulerOutput, *args, **kwargs):
        try:
            return self.model_runner.execute_model(sched, *args, **kwargs)
        except BaseException:  # its KV was never written: no request may hit the blocks offered when it was scheduled
            self.scheduler.block_manager.uncache(sched.cached_blocks)
            raise
