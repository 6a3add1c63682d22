"""LLMEngine: the front end of an engine (vLLM v1's LLMEngine), and the EngineClient that the offline API, the server
and the benchmarks drive: requests in (entrypoints/input_processor.py: validated, tokenized, grammar compiled), one
step at a time, RequestOutputs out (entrypoints/output_processor.py: detokenized, stop strings, logprobs).

The engine core behind it runs the scheduler and the model: in this process (engine/core.py, or engine/dp_core.py
over data-parallel replicas), or in a process of its own (engine/core_client.py; the server's, so that HTTP and
detokenization do not share an interpreter lock with the step loop). Either way the front end sees the same
interface: add_requests, abort_requests, step, stats, expert load, shutdown, on_death.
"""
import logging
from collections.abc import Iterable

from graphinfer.config import EngineConfig
from graphinfer.errors import InvalidConfigError, InvalidRequestError, LoRAAdapterError
from graphinfer.outputs import RequestOutput
from graphinfer.platforms import Platform, platform_for_device
from graphinfer.runtime.engine.core import EngineCore, engine_tokenizer
from graphinfer.runtime.engine.core_client import CoreProcClient
from graphinfer.runtime.engine.dp_core import DPEngineCore
from graphinfer.runtime.entrypoints.input_processor import InputProcessor, Request
from graphinfer.runtime.entrypoints.output_processor import OutputProcessor
from graphinfer.runtime.startup_timer import StartupTimer
from graphinfer.runtime.structured_output import StructuredOutputManager
from graphinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, platform: Platform | None = None, core_process: bool = False):
        """core_process: run the engine core in a process of its own (the server's); else in this one. platform: the
        one to run on (None: the device's)."""
        self.config = config
        if config.parallel_config.headless:
            raise InvalidConfigError("headless: this node runs data-parallel replicas only, no front end; start it "
                                     "with `graphinfer serve MODEL --headless ...` (node 0 runs the front end).")
        platform = platform or platform_for_device(str(config.model_config.device).split(":")[0])
        if core_process:
            self.engine_core = CoreProcClient(config, type(platform), "the engine core",
                                              data_parallel=config.parallel_config.data_parallel_size > 1)
            try:
                self.tokenizer = engine_tokenizer(config)  # while the core's process builds its engine
                info = self.engine_core.wait_ready()
            except BaseException:
                self.engine_core.shutdown(timeout=0)
                raise
            self.startup = StartupTimer()
            self.startup.seconds.update(info.startup)
            structured_output = StructuredOutputManager(self.tokenizer, info.hf_config.vocab_size,
                                                        info.eos_token_ids, None)
        else:
            core_cls = DPEngineCore if config.parallel_config.data_parallel_size > 1 else EngineCore
            self.engine_core = core_cls(config, platform)
            info = self.engine_core.info()
            local = self.engine_core.local if isinstance(self.engine_core, DPEngineCore) else self.engine_core
            self.tokenizer, self.startup, structured_output = local.tokenizer, local.startup, local.structured_output
        self.info = info
        self.max_model_len, self.hf_config, self.eos_token_ids = info.max_model_len, info.hf_config, info.eos_token_ids
        self.structured_output = structured_output
        structured_output.bound_compiles(config.structured_outputs_compile_timeout,
                                         config.structured_outputs_max_compiles)
        mc = config.model_config
        self.input_processor = InputProcessor(mc.model, self.tokenizer, self.hf_config.vocab_size,
                                              self.max_model_len, info.block_size, info.num_blocks, structured_output,
                                              mc.max_logprobs, mc.max_logprob_entries, config.lora_config.enable_lora,
                                              config.parallel_config.pipeline_parallel_size)
        self._loras: dict[int, str] = {}  # adapters the core has read and accepted: id -> path
        self.output_processor = OutputProcessor(self.tokenizer, spec_metrics=info.spec_decode)

    # ----- in-process introspection (tests, tools): the core, rank 0's worker -----
    @property
    def local_core(self) -> EngineCore:
        """The in-process EngineCore (replica 0's under data parallel)."""
        core = self.engine_core
        if isinstance(core, CoreProcClient):
            raise AttributeError("the engine core runs in another process")
        return core.local if isinstance(core, DPEngineCore) else core

    @property
    def worker(self):
        """Rank 0's Worker of the in-process core (None once shut down)."""
        return self.local_core.worker

    @property
    def pass_reports(self):
        """The passes' reports of the in-process core's compiled graph (docs/passes.md)."""
        return self.worker.compiled.pass_reports

    def save_artifact(self, out_dir: str, **check) -> dict:
        """Write what the in-process core compiled as a `graphinfer compile` artifact (EngineCore.save_artifact)."""
        return self.local_core.save_artifact(out_dir, **check)

    # ----- requests -----
    def tokenize(self, prompt: str) -> list[int]:
        return self.input_processor.tokenize(prompt)

    def make_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                     lora_request=None) -> Request:
        """Validate and tokenize one request without queueing it (any thread may call this)."""
        req = self.input_processor.make_request(prompt, params, request_id, lora_request)
        if lora_request is not None and self._loras.get(lora_request.lora_int_id) != lora_request.lora_path:
            self.add_lora(lora_request)
        if self.output_processor.in_use(req.request_id):
            raise InvalidRequestError(f"Request id {req.request_id!r} is already in use.")
        return req

    def add(self, req: Request, dp_rank: int | None = None) -> None:
        """Queue a request from make_request (data parallel: on replica dp_rank, None: the least loaded)."""
        if self.output_processor.in_use(req.request_id):
            raise InvalidRequestError(f"Request id {req.request_id!r} is already in use.")
        core_requests = self.output_processor.add_request(req)
        try:
            if dp_rank is not None:
                self.engine_core.add_requests(core_requests, dp_rank=dp_rank)
            else:
                self.engine_core.add_requests(core_requests)
        except BaseException:
            self.output_processor.abort_request(req.request_id)
            raise

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None,
                    lora_request=None) -> str:
        req = self.make_request(prompt, params, request_id, lora_request)
        self.add(req)
        return req.request_id

    # ----- LoRA adapters (vLLM's add_lora / remove_lora / list_loras) -----
    def add_lora(self, lora_request) -> bool:
        """Read and check the adapter now (a request naming it loads it too); LoRAAdapterError if it is refused."""
        error = self.engine_core.add_lora(lora_request)
        if error is not None:
            raise LoRAAdapterError(error)
        self._loras[lora_request.lora_int_id] = lora_request.lora_path
        return True

    def remove_lora(self, lora_int_id: int) -> bool:
        self._loras.pop(lora_int_id, None)
        return self.engine_core.remove_lora(lora_int_id)

    def list_loras(self) -> set[int]:
        return set(self.engine_core.list_loras())

    def abort_request(self, request_id: str) -> None:
        """Abort a request (every child of a parallel-sampling one) and free its blocks."""
        self.abort_requests([request_id])

    def abort_requests(self, request_ids: Iterable[str]) -> None:
        ids = [rid for request_id in request_ids for rid in self.output_processor.abort_request(request_id)]
        if ids and self.engine_core is not None:
            self.engine_core.abort_requests(ids)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests() or self.engine_core.has_unfinished_requests()

    def wake(self) -> None:
        """Make a step that waits for a core process's outputs return at once (the server: a request came in)."""
        if isinstance(core := self.engine_core, CoreProcClient):
            core.outputs.put("wake")

    # ----- stepping -----
    def step(self) -> list[RequestOutput]:
        """One step of the core (a core in another process: the outputs it sent meanwhile, waiting a little for
        them). Returns an output for each request that got a token (with output_kind FINAL_ONLY: only once it
        finished), after which the engine forgets finished ones; a streamed n > 1 request gets one per child that
        got a token. With async scheduling, the tokens returned are the previous step's."""
        outputs, stopped = self.output_processor.process(self.engine_core.step())
        if stopped:  # stop strings end requests here: the core frees them before its next step
            self.engine_core.abort_requests(stopped)
        return outputs

    # ----- statistics -----
    def stats(self) -> dict:
        """The scheduler's load (running, waiting, kv_usage, kv_blocks_in_use, preemptions; data parallel: summed
        over the replicas, KV usage their mean, each replica's own under "engines")."""
        return self.engine_core.stats() if self.engine_core is not None else self._final_stats

    def expert_load(self) -> dict[int, list[int]]:
        """Tokens routed to each expert since ready or the last reset ({} for a dense model). A host sync."""
        return self.engine_core.expert_load()

    def expert_load_summary(self, ep_size: int | None = None) -> dict:
        return self.engine_core.expert_load_summary(ep_size)

    def reset_expert_load(self) -> None:
        self.engine_core.reset_expert_load()

    def eplb_stats(self) -> dict:
        """EPLB (enable_eplb): rearrangements so far, bytes moved between EP ranks, and of the last rearrangement
        its window's EP-rank imbalance (max / mean tokens per rank, measured), the same load's imbalance under the
        plain contiguous placement, the predicted one of the new placement, its moved bytes and seconds;
        {"enabled": False} with EPLB off (also under data parallel: every replica's load counts)."""
        return self.engine_core.eplb_stats()

    def save_expert_map(self, path: str) -> str:
        """Write the current expert placement as vLLM-Ascend's expert-map JSON (load it with expert_map_path)."""
        return self.engine_core.save_expert_map(path)

    def spec_decode_stats(self) -> dict:
        """Speculative decoding's counters since start (SpecDecodingStats.as_dict), {} with it off."""
        return self.engine_core.spec_decode_stats() if self.info.spec_decode else {}

    def wait_for_kv_cache_pages(self) -> None:
        self.engine_core.wait_for_kv_cache_pages()

    # ----- death and shutdown -----
    @property
    def dead(self) -> str | None:
        """Why the engine can no longer run (a rank or replica died), or None."""
        return getattr(self.engine_core, "dead", None)

    def on_death(self, callback) -> None:
        """callback(message) once a rank or replica this engine needs dies."""
        self.engine_core.on_death(callback)

    @property
    def is_running(self) -> bool:
        return self.engine_core is not None

    def shutdown(self) -> None:
        """Release every device buffer the engine holds (graphs, KV cache, weights) and stop its processes. The
        engine cannot run afterwards."""
        core = getattr(self, "engine_core", None)
        if core is None:
            return
        self.abort_requests([*self.output_processor.parents, *self.output_processor.requests])
        core.shutdown()
        self._final_stats = core.stats()  # a core process's last word: its load once it had handled everything
        self.engine_core = None

