"""EngineCore (vLLM v1's): one engine replica's scheduler, KV blocks and step loop, over an executor that runs each
step on the replica's workers. Requests come in tokenized and validated (engine/request.py's EngineCoreRequest, from
the front end: entrypoints/); each step returns every sampling request's new tokens (EngineCoreOutput), which the
front end turns into text and RequestOutputs.

A step: proposals (speculative decoding) -> schedule -> (data-parallel lockstep: agree on the step's shape) ->
execute on the workers -> Scheduler.update_from_output, which alone advances a request.

Pipeline parallel (vLLM's batch queue): up to pipeline_parallel_size steps are in flight, one per stage. Each step()
schedules up to max_num_seqs / pp of the requests without a token on its way and launches them (the first stage's
forward, here), then lands the oldest step once the queue is full or nothing more can be scheduled, so the first
stage works on batch k+1 while the later stages still run batch k.

With async scheduling (vLLM's --async-scheduling) the core does not wait for a step's sampled tokens before
scheduling and launching the next: step N+1 is prepared and launched while step N runs on the device, its input ids
taken from step N's sampled tokens on the device, and step N's tokens are then landed (update_from_output) while step
N+1 runs. The price: a request that stops on a token (eos, stop ids) has computed one more row, which is dropped;
requests that stop on length never do.
"""
import gc
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from graphinfer.compiler import artifact
from graphinfer.compiler.artifact_export import export_artifact
from graphinfer.config import EngineConfig
from graphinfer.distributed import parallel_state as ps
from graphinfer.eplb import save_expert_map
from graphinfer.errors import GraphinferError, InvalidConfigError, LoRAAdapterError
from graphinfer.models.layers import rope_parameters
from graphinfer.models.loader import load_tokenizer
from graphinfer.platforms import Platform, platform_for_device
from graphinfer.runtime.engine import dp_lockstep
from graphinfer.runtime.engine.request import EngineCoreOutput, EngineCoreRequest
from graphinfer.runtime.engine.scheduler import Scheduler, SchedulerOutput
from graphinfer.runtime.engine.sequence import Sequence
from graphinfer.runtime.executor.factory import make_executor
from graphinfer.runtime.executor.parallel_layout import (check_artifact_parallel, check_parallel_config,
                                                         expert_parallel_size, model_config_of)
from graphinfer.runtime.spec_decode.mtp_proposer import check_mtp_engine
from graphinfer.runtime.spec_decode.proposer import make_proposer
from graphinfer.runtime.startup_timer import StartupTimer, seconds_since_process_start
from graphinfer.runtime.structured_output import StructuredOutputManager
from graphinfer.runtime.worker.expert_load import read_expert_load, reset_expert_load, summarize
from graphinfer.runtime.worker.worker import ModelOutput

logger = logging.getLogger(__name__)


@dataclass
class EngineCoreInfo:
    """What a front end needs of a core it did not build (engine/core_client.py sends it once the core is ready)."""
    max_model_len: int
    eos_token_ids: set[int]
    num_blocks: int
    block_size: int
    hf_config: object
    num_moe_layers: int  # MoE layers whose expert load is counted (0: a dense model)
    spec_decode: bool  # speculative decoding is on: its counters are exported
    startup: dict[str, float]  # the start-up phases' seconds (StartupTimer.seconds)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are not yet landed on the host (async scheduling)."""
    sched: SchedulerOutput
    output: ModelOutput


class EngineCore:
    def __init__(self, config: EngineConfig, platform: Platform | None = None):
        """platform: the one to run on (every data-parallel replica gets the front end's class); None: the
        device's."""
        started = time.perf_counter()
        self.config = config
        self.startup = timer = StartupTimer()
        if (since_start := seconds_since_process_start()) is not None:
            timer.record("imports (process start to engine start)", since_start)
        # Platform first: activating it loads its torch backend (npu: torch_npu), so "npu" parses below even with
        # TORCH_DEVICE_BACKEND_AUTOLOAD=0.
        self.platform = platform or platform_for_device(str(config.model_config.device).split(":")[0])
        self.backend = backend = self.platform.activate(config.compile_config.kernels)
        if config.artifact:
            check_artifact_parallel(config)
        if config.parallel_config.world_size > 1:
            check_parallel_config(config)
        if (spec := config.speculative_config) is not None and spec.method == "mtp":
            check_mtp_engine(config, model_config_of(config))
        # From an artifact, the tokenizer (mostly transformers' import) loads in a thread while the workers load the
        # weights and graph, where nothing else imports transformers meanwhile (its lazy module is not safe to import
        # from two threads at once; RoPE other than "default" uses transformers' init functions, and a model of
        # transformers' code is built by transformers).
        in_thread = bool(config.artifact) and \
            artifact.read_manifest(config.artifact).get("model_impl", "graphinfer") == "graphinfer" and \
            rope_parameters(artifact.load_config(config.artifact)).get("rope_type", "default") == "default"
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(_load_tokenizer, config, timer, "tokenizer (in a thread)") if in_thread else None
            self.executor = make_executor(config, self.platform, backend, timer)
            try:
                if pending is not None:
                    with timer.phase("tokenizer (wait for its thread)"):
                        self.tokenizer = pending.result()
                else:
                    self.tokenizer = _load_tokenizer(config, timer, "tokenizer")
            except BaseException:
                self.executor.shutdown()
                raise
        try:
            self._build()
        except BaseException:
            self._release()
            raise
        timer.record("engine ready", time.perf_counter() - started)

    def _build(self) -> None:
        """Everything past the workers: scheduler, structured outputs, the proposer, lockstep."""
        config = self.config
        worker = self.executor.driver_worker
        kv = worker.model_runner.kv_cache
        logger.info("KV cache: %d blocks x %d tokens, %s (%.1f MiB)", worker.num_blocks, config.cache_config.block_size,
                    str(kv.dtype).removeprefix("torch."), kv.numel() * kv.element_size() / 2**20)
        self.device, self.max_model_len = worker.device, worker.max_model_len
        self.hf_config = worker.hf_config
        self.eos_token_ids = eos_token_ids_of(self.hf_config, self.tokenizer)
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids, self.device,
            self.platform.device_module if self.device.type != "cpu" else None)
        self.proposer, self.spec_stats = make_proposer(config.speculative_config, self)
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, worker.num_blocks, self.max_model_len,
                                   self.structured_output, self.spec_stats,
                                   use_eagle=getattr(self.proposer, "use_eagle", False),
                                   max_loras=config.lora_config.max_loras if config.lora_config.enable_lora else 0)
        # MoE + expert parallel over several replicas: their MoE layers share all-to-alls, so they step together
        self.dp_lockstep = ps.dp_size() > 1 and ps.ep_size() > 1 and bool(worker.model_runner.moe_layers)
        self.lockstep = dp_lockstep.Lockstep(self.dp_lockstep)
        # Speculative decoding steps synchronously: drafts for step N+1 need step N's accepted tokens on the host
        self.async_scheduling = config.scheduler_config.async_scheduling and self.proposer is None
        self._in_flight: _InFlight | None = None
        # pipeline parallel: launched steps not yet landed, oldest first (vLLM's batch queue)
        self.pipeline_depth = config.parallel_config.pipeline_parallel_size
        self._batch_queue: deque[_InFlight] = deque()
        self.max_batches_in_flight = 0  # the most steps in flight at once so far (pipeline parallel)
        self.scheduler.set_pipeline(self.pipeline_depth)
        self._early_outputs: list[EngineCoreOutput] = []  # the in-flight step's, landed early by _mask_logits
        self.reset_expert_load()  # warm-up, capture and the passes' checks ran the MoE layers on synthetic inputs

    @property
    def worker(self):
        """Rank 0's Worker (None once shut down)."""
        return self.executor.driver_worker if self.executor is not None else None

    def info(self) -> EngineCoreInfo:
        worker = self.worker
        return EngineCoreInfo(self.max_model_len, self.eos_token_ids, worker.num_blocks,
                              self.config.cache_config.block_size, self.hf_config,
                              len(worker.model_runner.moe_layers), self.spec_stats is not None,
                              dict(self.startup.seconds))

    def save_artifact(self, out_dir: str, **check) -> dict:
        """Write what this engine compiled as a `graphinfer compile` artifact (compiler/artifact_export.py; check:
        atol, rtol, allow_check_failure); every tensor-parallel rank writes its shard."""
        worker = self.worker
        return export_artifact(out_dir, worker.compiled, self.config, self.tokenizer, worker.device,
                               write_ranks=lambda d: self.executor.collective_rpc("save_rank_files", d), **check)

    # ----- requests -----
    def add_request(self, req: EngineCoreRequest) -> None:
        seq = Sequence(req.request_id, req.prompt_token_ids, req.sampling_params, req.max_tokens, self.eos_token_ids,
                       req.lora_request)
        if req.grammar is not None:
            seq.grammar = self.structured_output.matcher(req.grammar)
        if (seed := req.sampling_params.seed) is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        self.scheduler.add_request(seq)

    def add_requests(self, reqs: list[EngineCoreRequest]) -> None:
        for req in reqs:
            self.add_request(req)

    # ----- LoRA adapters (never raise: a core process answers them on its reader thread) -----
    def add_lora(self, request) -> str | None:
        """Read and check the adapter (rank 0's worker; the other tensor-parallel ranks read it when a step first
        uses it) into the host cache; None, or why it was refused."""
        lora = self.worker.model_runner.lora
        if lora is None:
            return "LoRA is not enabled: start the engine with enable_lora=True (--enable-lora)."
        try:
            lora.add_lora(request)
        except LoRAAdapterError as e:
            return str(e)
        return None

    def remove_lora(self, lora_int_id: int) -> bool:
        lora = self.worker.model_runner.lora
        return lora is not None and lora.remove_lora(lora_int_id)

    def list_loras(self) -> list[int]:
        lora = self.worker.model_runner.lora
        return [] if lora is None else lora.list_loras()

    def abort_requests(self, request_ids) -> None:
        """End unfinished requests (aborts; stop strings the front end found); their blocks are freed now."""
        self.scheduler.finish_requests(request_ids, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def stats(self) -> dict:
        return self.scheduler.stats()

    # ----- stepping -----
    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run and sample one step; returns an output for each request that got tokens. With async
        scheduling, the tokens returned are the previous step's."""
        if self.pipeline_depth > 1:
            return self._step_pipelined()
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
                self.executor.execute_model(None, dp_step=dp)
            return []
        out = self._execute(sched, dp_step=dp, mask_logits=self._mask_logits)
        return self._land(sched, out)

    def _step_async(self) -> list[EngineCoreOutput]:
        outputs = []
        in_flight = self._in_flight
        if in_flight is not None and any(s.sampling_params.reads_output_tokens for s in in_flight.sched.rows):
            outputs = self._finish_in_flight()  # penalties, bad words: they read output tokens, on the host
        sched = self._schedule(in_flight=self._in_flight is not None)
        dp = self.lockstep.agree(sched)
        launched = None
        if not sched.scheduled and dp is not None:
            self.executor.execute_model(None, dp_step=dp)
        if sched.scheduled:
            in_flight = self._in_flight.output.sampled if self._in_flight is not None else None
            prev = in_flight.sampled_token_ids if in_flight is not None else None
            out = self._execute(sched, prev, share_sampled=True, dp_step=dp, mask_logits=self._mask_logits)
            outputs += self._early_outputs
            self._early_outputs = []
            # a step of prompt-logprob rows only stays in flight too: its rows land after the previous step's
            if out.sampled is not None or out.prompt_logprobs is not None:
                launched = _InFlight(sched, out)
        outputs += self._finish_in_flight()
        self._in_flight = launched
        return outputs

    def _step_pipelined(self) -> list[EngineCoreOutput]:
        """Launch a step of what can be scheduled; land the oldest in flight when the queue is full or nothing more
        could be launched (the requests left all have a token on its way)."""
        sched = self._schedule(in_flight=bool(self._batch_queue))
        if sched.scheduled:
            self._batch_queue.append(_InFlight(sched, self._execute(sched, mask_logits=self._mask_logits)))
            self.max_batches_in_flight = max(self.max_batches_in_flight, len(self._batch_queue))
        if self._batch_queue and (len(self._batch_queue) >= self.pipeline_depth or not sched.scheduled):
            step = self._batch_queue.popleft()
            try:
                return self._land(step.sched, step.output)
            except BaseException:
                self.scheduler.step_failed(step.sched)
                raise
        return []

    def pipeline_busy(self) -> list[float]:
        """Each pipeline stage's busy seconds so far (time computing, waits for another stage excluded); [] without
        pipeline parallel. Call between steps with nothing in flight (every rank answers)."""
        return self.executor.pipeline_busy() if self.pipeline_depth > 1 else []

    def _mask_logits(self, logits: torch.Tensor, rows: list[Sequence], spec_lens: list[int] | None) -> None:
        """The runner's hook between a step's forward (launched, still running on the device) and its sampling:
        structured outputs' grammar masks, filled on the host meanwhile. With async scheduling the in-flight step's
        tokens reach the matchers first (its outputs are returned with this step's)."""
        if self.structured_output.wants_mask(rows):
            self._early_outputs += self._finish_in_flight()
            self.structured_output.mask_logits(logits, rows, spec_lens)

    def _finish_in_flight(self) -> list[EngineCoreOutput]:
        step, self._in_flight = self._in_flight, None
        if step is None:
            return []
        return self._land(step.sched, step.output)

    def _land(self, sched: SchedulerOutput, out: ModelOutput) -> list[EngineCoreOutput]:
        """A step's results into the scheduler, once on the host: its prompt logprobs, then its sampled tokens."""
        if out.prompt_logprobs is not None:
            self.scheduler.update_prompt_logprobs(sched, out.wait_prompt_logprobs())
        return self.scheduler.update_from_output(sched, out.wait())

    def _schedule(self, in_flight: bool = False) -> SchedulerOutput:
        sched = self.scheduler.schedule()
        if not sched.scheduled and not in_flight and self.scheduler.has_unfinished_requests() and not sched.preempted:
            raise GraphinferError("Scheduler made no progress with requests pending; this is a bug.")
        return sched

    def _execute(self, sched: SchedulerOutput, *args, **kwargs) -> ModelOutput:
        try:
            return self.executor.execute_model(sched, *args, **kwargs)
        except BaseException:
            self.scheduler.step_failed(sched)
            raise

    # ----- statistics: expert load (worker/expert_load.py), speculative decoding -----
    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since ready or the last reset ({} for a dense model; rank 0's are the totals
        under tensor parallelism). A host sync: call it between steps."""
        return read_expert_load(self.worker.model_runner.moe_layers) if self.worker is not None else {}

    def expert_load_summary(self, ep_size: int | None = None) -> dict:
        """Tokens per EP rank and imbalances (max / mean) for ep_size (default: this engine's EP size)."""
        return summarize(self.expert_load(), ep_size or expert_parallel_size(self.config))

    def reset_expert_load(self) -> None:
        if self.worker is not None:
            reset_expert_load(self.worker.model_runner.moe_layers)

    def eplb_stats(self) -> dict:
        """EPLB's rearrangements, moved bytes and the EP-rank imbalance of the last window (EplbState.stats), the
        same on every rank; {"enabled": False} with EPLB off."""
        runner = self.worker.model_runner if self.worker is not None else None
        return runner.eplb.stats() if runner is not None and runner.eplb is not None else {"enabled": False}

    def save_expert_map(self, path: str) -> str:
        """Write the current expert placement (every MoE layer's experts on each EP rank) as vLLM-Ascend's
        expert-map JSON, which expert_map_path loads; returns the path."""
        layers = self.worker.model_runner.moe_layers
        if not layers:
            raise InvalidConfigError("save_expert_map: this model has no MoE layers (a dense model has no experts to "
                                     "place).")
        first = next(iter(layers.values()))
        placement = torch.tensor([m.placement for m in layers.values()], dtype=torch.int64)
        save_expert_map(path, placement, first.ep_size, first.global_num_experts)
        return path

    def spec_decode_stats(self) -> dict:
        """Speculative decoding's counters since start (SpecDecodingStats.as_dict), {} with it off."""
        return self.spec_stats.as_dict() if self.spec_stats is not None else {}

    def wait_for_kv_cache_pages(self) -> None:
        """Join the thread committing the KV cache's pages (cpu) if it still runs: the offline API does before its
        first step, so a batch job does not page-fault the cache in as it goes; the server does not wait."""
        if self.worker is not None:
            self.worker.model_runner.wait_for_kv_cache_pages()

    # ----- death and shutdown -----
    @property
    def dead(self) -> str | None:
        """Why the engine can no longer run (a tensor-parallel rank died), or None."""
        return self.executor.dead if self.executor is not None else None

    def on_death(self, callback) -> None:
        """callback(message) once a rank this engine needs dies."""
        if self.executor is not None:
            self.executor.on_death(callback)

    def shutdown(self) -> None:
        """Release every device buffer this engine holds: captured graphs and their pool, static buffers, the KV
        cache and the weights, then hand the freed memory back to the device. The engine cannot run afterwards."""
        if self._release(free_weights=True):
            gc.collect()
            self.platform.empty_cache()

    def _release(self, free_weights: bool = False) -> bool:
        """Stop the other ranks and free the workers' graphs and KV caches (free_weights: their weights too). False if
        already done."""
        executor, self.executor = getattr(self, "executor", None), None
        if executor is None:
            return False
        if hasattr(getattr(self, "proposer", None), "shutdown"):  # a draft model's worker
            self.proposer.shutdown()
        self.proposer = None
        if (scheduler := getattr(self, "scheduler", None)) is not None:
            scheduler.finish_requests(list(scheduler.requests))
        self._in_flight = None
        if hasattr(self, "_batch_queue"):
            self._batch_queue.clear()
        executor.shutdown(free_weights)
        return True

    def __del__(self):
        # The last reference dropped: release without waiting for a garbage collection. (Cached device memory is
        # reused by the next engine in this process; shutdown() also hands it back to the device.)
        try:
            self._release()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass


def eos_token_ids_of(hf_config, tokenizer) -> set[int]:
    eos = getattr(hf_config, "eos_token_id", None)
    if eos is None and tokenizer is not None:
        eos = tokenizer.eos_token_id
    return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])


def engine_tokenizer(config: EngineConfig):
    """The tokenizer of the engine's artifact or model (None where it ships none)."""
    if config.artifact:
        return artifact.load_tokenizer(config.artifact)
    return load_tokenizer(config.model_config.model)


def _load_tokenizer(config: EngineConfig, timer: StartupTimer, phase: str):
    with timer.phase(phase):
        return engine_tokenizer(config)
