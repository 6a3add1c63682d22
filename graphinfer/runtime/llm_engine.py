"""LLMEngine: requests in, one scheduled + executed + sampled step at a time, RequestOutputs out.

With async scheduling (vLLM's --async-scheduling) the host does not wait for a step's sampled tokens before
scheduling and launching the next: step N+1 is prepared and launched while step N runs on the device, its
input ids taken from step N's sampled tokens on the device, and step N's tokens are then appended, checked
for stops and returned while step N+1 runs. The price: a request that stops on a token (eos, stop ids or
strings) has computed one more row, which is dropped; requests that stop on length never do.
"""
import dataclasses
import gc
import hashlib
import itertools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch
from torch import fx

from graphinfer import envs
from graphinfer.compiler import artifact, kernel_cache
from graphinfer.compiler.compile import compile_model
from graphinfer.compiler.fingerprint import model_fingerprint
from graphinfer.compiler.piecewise import fit_graph_budget
from graphinfer.compiler.skinny_gemm import event_timer, lower_skinny_gemm
from graphinfer.compiler.split import DEFAULT_SPLITTING_OPS, split_graph
from graphinfer.compiler.trace import rebind_buffers, trace_model
from graphinfer.config import FULL_GRAPH_MODES, PIECEWISE_GRAPH_MODES, EngineConfig, default_capture_sizes
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import (ArtifactMismatchError, GraphinferError, InvalidConfigError, InvalidRequestError,
                               KVCacheTooSmallError, PromptTooLongError)
from graphinfer.models.layers import activation_dtype, rope_parameters
from graphinfer.models.loader import load_config, load_model, load_tokenizer, release_tensors
from graphinfer.models.parallel_layers import check_tensor_parallel, uses_expert_parallel
from graphinfer.models.presets import PRESET_NAMES
from graphinfer.passes import PassCheckError, resolve_passes
from graphinfer.platforms import Platform, platform_for_device
from graphinfer.passes.utils import release_fused_sources
from graphinfer.outputs import CompletionOutput, Logprob, RequestOutput
from graphinfer.runtime.detokenizer import IncrementalDetokenizer, find_stop_string
from graphinfer.runtime import dp_lockstep
from graphinfer.runtime.executor import MultiprocExecutor
from graphinfer.runtime.expert_load import read_expert_load, reset_expert_load, summarize
from graphinfer.runtime.model_runner import ModelRunner
from graphinfer.runtime.parallel_sampling import ParentRequest, make_children
from graphinfer.runtime.sampler import SamplerOutput
from graphinfer.runtime.scheduler import Scheduler, SchedulerOutput
from graphinfer.runtime.sequence import Sequence, SequenceStatus
from graphinfer.runtime.spec_decode import NgramProposer
from graphinfer.runtime.spec_decode.metrics import SpecDecodingStats
from graphinfer.runtime.spec_decode.verify import warm_up_rejection_sample
from graphinfer.runtime.startup_timer import StartupTimer, seconds_since_process_start
from graphinfer.runtime.structured_output import StructuredOutputManager
from graphinfer.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class _InFlight:
    """A launched step whose sampled tokens are not yet read on the host (async scheduling)."""
    sched: SchedulerOutput
    rows: list[Sequence]  # the sequences that sample, row i of `sampled`
    sampled: SamplerOutput  # on the device: the next step's pending input ids come from here
    host: SamplerOutput  # its non-blocking host copy, valid once `event` has completed
    event: object  # None on cpu


def model_config_of(config: EngineConfig):
    return artifact.load_config(config.artifact) if config.artifact else load_config(config.model_config.model)


def check_parallel_config(config: EngineConfig) -> None:
    """Refuse a tensor / expert / data-parallel layout the model cannot take (with the numbers) before any rank
    or replica starts."""
    pc = config.parallel_config
    if pc.node_rank != 0:
        raise InvalidConfigError(
            f"node_rank={pc.node_rank}: nodes other than 0 run workers only; start them with "
            f"`graphinfer serve|generate|compile|bench ... --node-rank N` (graphinfer.runtime.worker.run_node).")
    model = model_config_of(config)
    check_tensor_parallel(model, pc.tensor_parallel_size, pc.enable_expert_parallel, pc.data_parallel_size)
    if config.artifact and pc.data_parallel_size > 1 and uses_expert_parallel(model, pc.world_size,
                                                                               pc.enable_expert_parallel):
        raise InvalidConfigError(
            f"Artifact {config.artifact!r}: expert parallel over data_parallel_size={pc.data_parallel_size} replicas "
            f"runs from the checkpoint for now (an artifact's experts are laid out over its tensor-parallel ranks "
            f"only): serve the model's checkpoint with --data-parallel-size {pc.data_parallel_size} "
            f"--enable-expert-parallel, or leave data parallel off.")


class LLMEngine:
    def __init__(self, config: EngineConfig, platform: Platform | None = None):
        """platform: the one to run on (a tensor-parallel worker gets rank 0's); None: the device's."""
        self.config = config
        self.executor = None  # tensor parallel, on rank 0: the other ranks (runtime/executor.py)
        self._is_worker = ps.is_initialized()  # a rank > 0: its group is this engine's to destroy on release
        # Platform first: activating it loads its torch backend (npu: torch_npu), so "npu" parses below even
        # with TORCH_DEVICE_BACKEND_AUTOLOAD=0.
        self.platform = platform or platform_for_device(str(config.model_config.device).split(":")[0])
        self.platform.activate(config.compile_config.kernels)
        self.manifest = artifact.read_manifest(config.artifact) if config.artifact else None
        if self.manifest is not None:
            self._check_artifact_tensor_parallel()
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
        mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
        torch.manual_seed(mc.seed)
        self.device = torch.device(mc.device)
        if ps.is_initialized() and self.device.type != "cpu" and self.device.index is None:
            self.device = torch.device(self.device.type, ps.local_rank())  # one device per rank of this node
        memory_at_start = self.platform.memory_allocated(self.device)
        comp = config.compile_config
        if comp.graph_mode is None:
            comp.graph_mode = self.platform.default_graph_mode(comp.kernels)
        self._check_graph_mode()
        self.capture_sizes = comp.capture_sizes or default_capture_sizes(comp.max_capture_size)  # derived in config
        if self.manifest is not None and envs.GRAPHINFER_KERNEL_CACHE != "off":
            kernel_cache.use(config.artifact, self.device)  # before any kernel compiles
        # From an artifact, the tokenizer (mostly transformers' import) loads in a thread while the weights and graph
        # load, where nothing else imports transformers meanwhile (its lazy module is not safe to import from two
        # threads at once; RoPE other than "default" uses transformers' init functions).
        in_thread = self.manifest is not None and ps.tp_rank() == 0 and \
            rope_parameters(artifact.load_config(config.artifact)).get("rope_type", "default") == "default"
        with ThreadPoolExecutor(1) as pool:
            tokenizer = pool.submit(self._load_tokenizer, "tokenizer (in a thread)") if in_thread else None
            with timer.phase("weights"):
                self.model, self.hf_config = self._load_model()
            with timer.phase("graph"):
                self.graph, self.pass_reports = self._compile()
            if tokenizer is not None:
                with timer.phase("tokenizer (wait for its thread)"):
                    self.tokenizer = tokenizer.result()
            elif ps.tp_rank() == 0:  # the other ranks neither tokenize nor detokenize
                self.tokenizer = self._load_tokenizer("tokenizer")
            else:
                self.tokenizer = None
        self.max_model_len = self._resolve_max_model_len(mc.max_model_len)
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < self.max_model_len:
            raise InvalidConfigError(
                f"max_num_batched_tokens={sc.max_num_batched_tokens} < max_model_len={self.max_model_len} "
                f"without chunked prefill: long prompts could never be scheduled. Raise max_num_batched_tokens, "
                f"lower max_model_len, or enable_chunked_prefill=True.")
        self.eos_token_ids = self._eos_token_ids()
        with timer.phase("KV cache"):
            engine_bytes = self.platform.memory_allocated(self.device) - memory_at_start
            self.model_runner = ModelRunner(self.model, cc, self.device, self.platform, self.eos_token_ids, mc.seed,
                                            self.max_model_len, engine_bytes, placeholder_kv=config.compile_only,
                                            graph=self.graph, step_tokens=sc.max_num_batched_tokens,
                                            logits_rows=sc.max_num_seqs,
                                            graph_tokens=max(self.capture_sizes) if comp.graph_mode != "NONE" else 0)
        if self.executor is not None and ps.tp_size() > 1:
            self.model_runner.channel = self.executor.channel
        # MoE + expert parallel over several replicas: their MoE layers share all-to-alls, so they step together
        self.dp_lockstep = ps.dp_size() > 1 and ps.ep_size() > 1 and bool(self.model_runner.moe_layers)
        self.dp_stopped = False  # lockstep: the front end ended the replicas' rounds
        if isinstance(self.graph, fx.GraphModule):
            rebind_buffers(self.graph, self.model)  # onto the runner's KV cache
        self.model_runner.graph = self.platform.compile_graph(self.graph, comp.kernels)  # cpu: Inductor
        self.skinny_gemm = None  # decode linears on the skinny GEMM kernel where measured faster (for reports)
        if self.platform.supports_skinny_gemm(comp.kernels):
            with timer.phase("skinny gemm (measure)"):
                timer_fn = event_timer(self.platform.device_module) if self.device.type != "cpu" else None
                self.skinny_gemm, self.model_runner.graph = lower_skinny_gemm(self._fx_graph(), sc.max_num_seqs,
                                                                              timer_fn)
        if comp.npu_compiler:
            self.model_runner.graph = self._torchair(comp.npu_compiler)
        if self.device.type != "cpu":  # cpu: compile_graph above compiled (Inductor) or there is nothing to compile
            with timer.phase("kernels"):  # compiles (or loads from the kernel cache) the prefill path's kernels
                self.model_runner.warm_up()
                if config.speculative_config is not None:
                    warm_up_rejection_sample(self.device)
                # structured outputs' mask kernel, compiled (or loaded) now rather than at the first such request
                logits = torch.zeros(1, self.hf_config.vocab_size, dtype=activation_dtype(self.model),
                                     device=self.device)
                torch.ops.graphinfer.apply_token_bitmask(logits, torch.full((1, -(-logits.shape[1] // 32)), -1,
                                                                            dtype=torch.int32, device=self.device))
        capture = not config.compile_only or self.device.type != "cpu"  # compile on a GPU: warm every bucket's kernels
        self.capture_stats = self.piecewise_capture_stats = None
        if comp.graph_mode in FULL_GRAPH_MODES and capture:
            with timer.phase("capture (decode graphs)"):
                self.capture_stats = self.model_runner.capture_decode_graphs(
                    self._decode_capture_sizes(), self.max_model_len, comp.capture_lm_head)
            if (spec := config.speculative_config) is not None:  # uniform 1 + k token verification steps
                with timer.phase("capture (verify graphs)"):
                    self.model_runner.capture_decode_graphs(self._decode_capture_sizes(), self.max_model_len,
                                                            comp.capture_lm_head,
                                                            query_len=1 + spec.num_speculative_tokens)
        self.split = None
        if comp.graph_mode in PIECEWISE_GRAPH_MODES:
            self.split = split_graph(self._fx_graph(), comp.splitting_ops or DEFAULT_SPLITTING_OPS)
            logger.info("split: %s", self.split.info.summary())
            if capture:
                with timer.phase("capture (piecewise graphs)"):
                    self.piecewise_capture_stats = self.model_runner.capture_piecewise_graphs(
                        self.split, self._piecewise_capture_sizes(self.split.info.num_pieces))
        self.scheduler = Scheduler(sc, cc, self.model_runner.num_blocks)
        self.proposer, self.spec_stats = self._spec_decoding(config.speculative_config)
        # Speculative decoding steps synchronously: drafts for step N+1 need step N's accepted tokens on the host
        self.async_scheduling = sc.async_scheduling and self.proposer is None
        self._in_flight: _InFlight | None = None
        self._early_outputs: list[RequestOutput] = []  # the in-flight step's, finished early by _mask_logits
        self.structured_output = StructuredOutputManager(
            self.tokenizer, self.hf_config.vocab_size, self.eos_token_ids, self.device,
            self.platform.device_module if self.device.type != "cpu" else None)
        self.requests: dict[str, Sequence] = {}  # the sequences that run (a parallel-sampling request's children)
        self.parents: dict[str, ParentRequest] = {}  # parallel-sampling requests by their id
        self._ids = itertools.count()
        self.reset_expert_load()  # warm-up, capture and the passes' checks ran the MoE layers on synthetic inputs
        timer.record("engine ready", time.perf_counter() - started)

    def _spec_decoding(self, spec):
        """The proposer and the counters for speculative_config, or (None, None)."""
        if spec is None or self.config.compile_only:  # compile: only the verify graphs (warmed on a GPU) matter
            return None, None
        if self.config.scheduler_config.async_scheduling:
            logger.info("speculative decoding: steps run synchronously (the drafts need the last step's tokens)")
        if spec.method == "ngram":
            proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        else:  # it builds an LLMEngine of its own
            from graphinfer.runtime.spec_decode.draft_model import DraftModelProposer

            proposer = DraftModelProposer(spec, self)
        return proposer, SpecDecodingStats(spec.num_speculative_tokens)

    def spec_decode_stats(self) -> dict:
        """Speculative decoding's counters since start (SpecDecodingStats.as_dict), {} with it off."""
        return self.spec_stats.as_dict() if self.spec_stats is not None else {}

    # ----- expert load (runtime/expert_load.py) -----
    @property
    def expert_parallel_size(self) -> int:
        """The EP size the load is summarised for: tp x dp with expert parallel on (and experts to split), else 1."""
        pc = self.config.parallel_config
        ranks = pc.world_size
        return ranks if uses_expert_parallel(self._model_config(), ranks, pc.enable_expert_parallel) else 1

    def expert_load(self) -> dict[int, list[int]]:
        """MoE layer index -> tokens routed to each expert since the engine was ready (or the last
        reset_expert_load); {} for a dense model. A host sync: call it between steps, not on the step path.
        Under tensor parallelism rank 0's counts are the totals (every rank routes the same tokens)."""
        runner = getattr(self, "model_runner", None)
        return read_expert_load(runner.moe_layers) if runner is not None else {}

    def expert_load_summary(self, ep_size: int | None = None) -> dict:
        """expert_load() with tokens per EP rank and imbalances (max / mean), for ep_size (default: this
        engine's expert-parallel size) under the contiguous expert placement."""
        return summarize(self.expert_load(), ep_size or self.expert_parallel_size)

    def reset_expert_load(self) -> None:
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            reset_expert_load(runner.moe_layers)

    def shutdown(self) -> None:
        """Release every device buffer this engine holds: captured graphs and their pool, static buffers, the KV
        cache and the weights (also those of modules something else still refers to), then hand the freed memory
        back to the device. The engine cannot run afterwards."""
        graph, model = self.graph, self.model
        if not self._release():
            return
        for module in (graph, model):
            if isinstance(module, torch.nn.Module):
                release_tensors(module)
        del graph, model
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
        runner, graph = getattr(self, "model_runner", None), getattr(self, "graph", None)
        if runner is None and graph is None:  # released, or __init__ failed before loading anything
            return False
        if hasattr(getattr(self, "proposer", None), "shutdown"):  # a draft model's engine
            self.proposer.shutdown()
        self.proposer = None
        for request_id in [*getattr(self, "parents", ()), *getattr(self, "requests", ())]:
            self.abort_request(request_id)
        self._in_flight = None
        runner_graph = getattr(runner, "graph", None)
        if runner is not None:
            runner.release()
        for gm in {id(g): g for g in (graph, runner_graph) if isinstance(g, fx.GraphModule)}.values():
            gm.graph.owning_module = None  # an fx GraphModule and its Graph refer to each other: no cycle left
        self.model_runner = self.graph = self.model = self.split = None
        return True

    def __del__(self):
        # The last reference dropped: release without waiting for a garbage collection. (Cached device memory is
        # reused by the next engine in this process; shutdown() also hands it back to the device.)
        try:
            self._release()
        except Exception:  # interpreter shutdown: modules may already be gone
            pass

    def _model_config(self):
        return model_config_of(self.config)

    def _check_artifact_tensor_parallel(self) -> None:
        """Refuse an artifact compiled for another tensor-parallel size (its weights are split for that many ranks)
        before starting any rank."""
        art, tp = self.config.artifact, self.config.parallel_config.tensor_parallel_size
        compiled = artifact.tensor_parallel_size(self.manifest)
        if compiled != tp:
            raise ArtifactMismatchError(
                f"Artifact {art!r} was compiled for tensor_parallel_size={compiled}, but this engine runs "
                f"tensor_parallel_size={tp}. Run it with --tensor-parallel-size {compiled} (LLM(tensor_parallel_size="
                f"{compiled})), or recompile it for {tp}: graphinfer compile {self.manifest['model']['path']} -o {art} "
                f"--tensor-parallel-size {tp}")
        ep = uses_expert_parallel(self._model_config(), tp, self.config.parallel_config.enable_expert_parallel)
        if ep != (compiled := artifact.expert_parallel(self.manifest)):
            state = {True: "on", False: "off"}
            run = "with" if compiled else "without"
            raise ArtifactMismatchError(
                f"Artifact {art!r} was compiled with expert parallel {state[compiled]}, but this engine runs it "
                f"{state[ep]} (the experts are laid out over the ranks differently). Run it {run} "
                f"--enable-expert-parallel (LLM(enable_expert_parallel={compiled})), or recompile it: graphinfer "
                f"compile {self.manifest['model']['path']} -o {art} --tensor-parallel-size {tp}"
                + (" --enable-expert-parallel" if ep else ""))

    def _check_graph_mode(self) -> None:
        cc = self.config.compile_config
        if cc.graph_mode == "NONE":
            return
        if not self.platform.supports_graph_capture:
            raise InvalidConfigError(f"graph_mode={cc.graph_mode!r} replays device graphs (CUDA graphs / ACL graphs); "
                                     f"the {self.platform.name} platform has none. Use graph_mode='NONE' there.")
        if cc.kernels == "reference":
            raise InvalidConfigError("kernels='reference' runs the PyTorch reference ops, which read lengths on the "
                                     "host and cannot be captured; use the platform's kernels or graph_mode='NONE'.")

    def _decode_capture_sizes(self) -> list[int]:
        """Full decode graphs: the capture sizes a decode batch can have (at most max_num_seqs rows)."""
        mns = self.config.scheduler_config.max_num_seqs
        return [s for s in self.capture_sizes if s <= mns] or [min(self.capture_sizes)]

    def _piecewise_capture_sizes(self, num_pieces: int) -> list[int]:
        """Piecewise graphs: the capture sizes a step can have (at most max_num_batched_tokens tokens), within the
        platform's graph budget (Ascend: its streams) after the full decode graphs took theirs."""
        mbt = self.config.scheduler_config.max_num_batched_tokens
        sizes = [s for s in self.capture_sizes if s <= mbt] or [min(self.capture_sizes)]
        budget = self.platform.capture_budget(int(ps.tp_size() > 1), num_pieces)  # Ascend: HCCL takes streams too
        if budget is None:
            return sizes
        if self.config.compile_config.graph_mode in FULL_GRAPH_MODES:
            budget -= len(self._decode_capture_sizes())
        return fit_graph_budget(sizes, num_pieces, budget)

    def _fx_graph(self) -> fx.GraphModule:
        """The fused forward as an fx graph, as the runner executes it: with skinny GEMM linears where start-up
        chose them, else the engine's graph (an artifact's graph.py is re-traced: same nodes, no passes)."""
        if self.skinny_gemm is not None:
            return self.model_runner.graph
        if isinstance(self.graph, fx.GraphModule):
            return self.graph
        return trace_model(self.graph)

    def _torchair(self, spec: str):
        """The fused graph handed to torchair (it captures ACL graphs itself); self.graph stays the fx module."""
        from graphinfer.compiler.torchair_backend import compile_with_torchair

        if self.platform.name != "npu":
            raise InvalidConfigError(f"npu_compiler={spec!r} needs the npu platform; this engine runs on "
                                     f"{self.platform.name}. Drop npu_compiler or use device='npu'.")
        mode = spec.partition(":")[2] or "npugraph_ex"
        return compile_with_torchair(self.graph, mode, kernels=self.platform.kernels)

    def _load_tokenizer(self, phase: str):
        with self.startup.phase(phase):
            if self.manifest is not None:
                return artifact.load_tokenizer(self.config.artifact)
            return load_tokenizer(self.config.model_config.model)

    def _load_model(self):
        """(model, hf_config): an artifact's final weights (checked against its manifest, and against the model
        named with it, if any), else the checkpoint's."""
        mc = self.config.model_config
        if self.manifest is None:
            return load_model(mc.model, mc.torch_dtype, self.device, mc.seed, mc.quantization)
        art, manifest = self.config.artifact, self.manifest
        named = mc.model if mc.model in PRESET_NAMES else os.path.abspath(mc.model)
        fingerprint = None
        # another model named with the artifact: is it the same one? (rank 0 checks, the others follow its verdict)
        if named != manifest["model"]["path"] and ps.tp_rank() == 0:
            fingerprint = model_fingerprint(mc.model, load_config(mc.model), mc.seed)
        self._verify_artifact(fingerprint)
        if manifest["graph_mode"] != self.config.compile_config.graph_mode:
            raise ArtifactMismatchError(f"Artifact {art!r} was compiled for graph_mode={manifest['graph_mode']!r}; "
                                        f"run it with that mode or recompile.")
        hf_config = artifact.load_config(art)
        return artifact.load_model(art, manifest, hf_config, self.device), hf_config

    def _verify_artifact(self, fingerprint: dict | None) -> None:
        """Each rank checks the files it reads (artifact.verify_artifact). In a tensor-parallel group every rank then
        learns every rank's verdict, so that all stop together, with the first rank's reasons that found any (one
        rank's shard alone may be damaged)."""
        try:
            artifact.verify_artifact(self.config.artifact, self.manifest, device=self.device,
                                     dtype=self.config.model_config.torch_dtype, fingerprint=fingerprint)
            error = None
        except ArtifactMismatchError as e:
            error = str(e)
        for rank, found in enumerate(ps.all_gather_object(error)):
            if found is not None:
                raise ArtifactMismatchError(found if rank == 0 else f"(found by rank {rank}) {found}")

    def _compile(self):
        """The forward the runner executes: traced and optimised by the passes, or read from an artifact."""
        if self.manifest is not None:
            return artifact.load_graph(self.config.artifact, self.manifest, self.model), artifact.load_reports(self.manifest)
        gm, reports = compile_model(self.model, resolve_passes(self.config.compile_config.passes))
        if not reports.passed:  # `compile` refuses such a graph; here it runs, loudly
            logger.warning("passes changed the model's outputs beyond the check's tolerances: %s",
                           "; ".join(reports.failures()))
        release_fused_sources(self.model, gm.meta.get("fused_linears", {}))
        return gm, reports

    def save_artifact(self, out_dir: str, *, atol: float | None = None, rtol: float | None = None,
                      allow_check_failure: bool = False) -> dict:
        """Write this engine's compiled graph as a `graphinfer compile` artifact. Refused (PassCheckError) when a
        pass, or the pipeline end to end, fails its numeric check at atol / rtol (None: the dtype's defaults),
        unless allow_check_failure, which the manifest then records."""
        if not isinstance(self.graph, fx.GraphModule):
            raise InvalidConfigError("This engine runs a loaded artifact; compile from the model to write a new one.")
        reports = self.pass_reports.rejudge(atol, rtol)
        failures = reports.failures()
        if failures and not allow_check_failure:
            raise PassCheckError("The passes change the model's outputs beyond the check's tolerances, so no "
                                 "artifact was written:\n  " + "\n  ".join(failures) + "\nFix the pass, set "
                                 "tolerances (--atol / --rtol) or override (--allow-check-failure, recorded).")
        e2e = reports.end_to_end
        check = {"passed": not failures, "failures": failures, "atol": atol, "rtol": rtol,
                 "overridden": bool(failures)}  # written despite failed checks (--allow-check-failure)
        if e2e is not None:
            check.update(atol=e2e.atol, rtol=e2e.rtol)
        mc = self.config.model_config
        artifact.prepare_dir(out_dir, self.graph, self.model)
        if self.executor is not None:
            self.executor.channel.call("save_rank_files", out_dir)  # the other ranks write their shards meanwhile
        self.save_rank_files(out_dir)
        return artifact.save_artifact(
            out_dir, self.graph, reports, fingerprint=model_fingerprint(mc.model, self.hf_config, mc.seed),
            device=self.device, dtype=mc.torch_dtype, graph_mode=self.config.compile_config.graph_mode,
            capture_sizes=self.capture_sizes, split=self.split.info if self.split is not None else None,
            model=self.model, hf_config=self.hf_config, tokenizer=self.tokenizer, check=check,
            tensor_parallel_size=self.config.parallel_config.tensor_parallel_size,
            expert_parallel=any(getattr(m, "ep_size", 1) > 1 for m in self.model.modules()),
            quantization=self.config.model_config.quantization,
            speculative_config=dataclasses.asdict(spec) if (spec := self.config.speculative_config) else None)

    def save_rank_files(self, out_dir: str) -> None:
        """Write this rank's weights (and what passes added) into the artifact directory out_dir (from save_artifact:
        on rank 0 directly, on the others through the step channel), then wait for every rank's. That wait is what
        orders the other ranks' writes before rank 0 hashes their files (channel.call only sends the message): a
        collective that gathers each rank's failure, if any (a rank that failed joins it too, so none waits
        forever), and the digest of its graph code, which must be rank 0's: graph.py is written once, for all."""
        error = None
        try:
            artifact.save_rank_files(out_dir, self.graph, self.model, ps.tp_rank(), ps.tp_size())
        except Exception as e:  # rank 0 raises it, below
            error = e
        digest = hashlib.sha256(artifact.graph_source(self.graph).encode()).hexdigest()
        ranks = ps.all_gather_object((None if error is None else f"{type(error).__name__}: {error}", digest))
        if ps.tp_rank() > 0:
            return
        if error is not None:
            raise error
        if failed := [f"rank {r}: {e}" for r, (e, _) in enumerate(ranks) if e is not None]:
            raise GraphinferError(f"Not every rank could write its files into {out_dir!r}, so the artifact is "
                                  f"incomplete:\n  " + "\n  ".join(failed))
        if differ := [r for r, (_, d) in enumerate(ranks) if d != digest]:
            raise GraphinferError(f"Ranks {differ} compiled other graph code than rank 0, so one graph.py cannot serve "
                                  f"them all; a layer puts rank-dependent values into the graph (a bug: keep them in "
                                  f"buffers, as VocabParallelEmbedding does).")

    def _resolve_max_model_len(self, requested: int | None) -> int:
        model_len = getattr(self.hf_config, "max_position_embeddings", None) or 2048
        if requested is None:
            return model_len
        if requested > model_len:
            raise InvalidConfigError(f"max_model_len={requested} exceeds the model's context length {model_len}; "
                                     f"use max_model_len <= {model_len}.")
        return requested

    def _eos_token_ids(self) -> set[int]:
        eos = getattr(self.hf_config, "eos_token_id", None)
        if eos is None and self.tokenizer is not None:
            eos = self.tokenizer.eos_token_id
        return set(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    # ----- requests -----
    def tokenize(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError(f"{self.config.model_config.model!r} ships no tokenizer: pass prompts as token ids.")
        return self.tokenizer(prompt).input_ids

    def make_sequence(self, prompt: str | list[int] | dict, params: SamplingParams | None,
                      request_id: str | None = None) -> Sequence:
        """Validate and tokenize one request without queueing it (so a batch can be checked first)."""
        params = params or SamplingParams()
        if isinstance(prompt, dict):  # vLLM's TokensPrompt / TextPrompt
            prompt = prompt.get("prompt_token_ids", prompt.get("prompt"))
        text = prompt if isinstance(prompt, str) else None
        ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise PromptTooLongError("The prompt is empty; give at least one token.")
        vocab = self.hf_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"Prompt token ids must be integers in [0, {vocab}).")
        if any(t >= vocab for t in params.stop_token_ids):  # the sampler masks them by index (min_tokens)
            raise InvalidRequestError(f"stop_token_ids must be token ids in [0, {vocab}).")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"The prompt has {len(ids)} tokens, but max_model_len is {self.max_model_len}, which must leave "
                f"room for at least one generated token. Shorten the prompt or raise max_model_len.")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        blocks = self.scheduler.block_manager.blocks_needed(len(ids) + max_tokens - 1)
        if blocks > self.model_runner.num_blocks:
            raise KVCacheTooSmallError(
                f"The request needs {blocks} KV-cache blocks ({len(ids)} prompt + {max_tokens} new tokens), but the "
                f"cache has only {self.model_runner.num_blocks}. Lower max_tokens, or give the cache more memory "
                f"(kv_cache_memory_bytes / num_gpu_blocks_override).")
        request_id = str(next(self._ids)) if request_id is None else request_id
        if request_id in self.requests or request_id in self.parents:
            raise InvalidRequestError(f"Request id {request_id!r} is already in use.")
        seq = Sequence(request_id, text, ids, params, max_tokens)
        if params.num_candidates > 1:  # parallel sampling: the children run, seq stands for the request
            seq.children = make_children(seq)
        for s in seq.children or [seq]:
            if params.structured_outputs is not None:  # compiled once (the server: on its preprocessing threads)
                s.grammar = self.structured_output.grammar_init(params.structured_outputs)
            if s.sampling_params.seed is not None:
                s.generator = torch.Generator(device=self.device).manual_seed(s.sampling_params.seed)
            if self.tokenizer is not None:
                s.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        if seq.children:
            self.parents[seq.request_id] = ParentRequest(seq)
        for s in seq.children or [seq]:
            self.requests[s.request_id] = s
            self.scheduler.add(s)

    def add_request(self, request_id: str | None, prompt, params: SamplingParams | None = None) -> str:
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> None:
        """Abort a request (every child of a parallel-sampling one) and free its blocks."""
        parent = self.parents.pop(request_id, None)
        for seq in parent.children if parent is not None else [self.requests.get(request_id)]:
            if seq is not None and self.requests.pop(seq.request_id, None) is not None and not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def scheduler_stats(self) -> dict:
        """The scheduler's load, for /metrics and the data-parallel front end."""
        sched = self.scheduler
        return {"running": len(sched.running), "waiting": len(sched.waiting), "kv_usage": sched.block_manager.usage,
                "preemptions": sched.num_preemptions}

    @property
    def dead(self) -> str | None:
        """Why the engine can no longer run (a tensor-parallel rank died), or None."""
        return self.executor.dead if self.executor is not None else None

    def on_death(self, callback) -> None:
        """callback(message) once a rank this engine needs dies."""
        if self.executor is not None:
            self.executor.death_listeners.append(callback)

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
        dp = self._dp_agree(sched)
        if not sched.scheduled:
            if dp is not None:  # another replica has work: run the padding its MoE all-to-alls pair with
                self.model_runner.execute_model(None, dp_step=dp)
            return []
        rows, sampled = self._execute(sched, dp_step=dp, mask_logits=self._mask_logits)
        for seq, n in sched.scheduled:
            seq.num_computed_tokens += n - len(seq.spec_token_ids)  # drafts count once accepted (_accept_drafts)
        if sampled is None:
            return []
        return self._process(rows, sampled.to_host())

    def _step_async(self) -> list[RequestOutput]:
        outputs = []
        if self._in_flight is not None and any(s.sampling_params.has_penalties for s in self._in_flight.rows):
            outputs = self._finish_in_flight()  # penalties count output tokens: they must be on the host
        sched = self._schedule(in_flight=self._in_flight is not None)
        dp = self._dp_agree(sched)
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
        return self._process(step.rows, step.host)

    def _dp_agree(self, sched: SchedulerOutput, stop: bool = False) -> "dp_lockstep.DPStep | None":
        """Lockstep replicas (runtime/dp_lockstep.py): the step shape every replica pads to, or None when no
        replica has work (or the front end stopped the rounds: dp_stopped). Otherwise None."""
        if not self.dp_lockstep:
            return None
        step = dp_lockstep.agree(sched, stop)
        self.dp_stopped |= step.stop
        return step if step.num_tokens and not step.stop else None

    def stop_dp_rounds(self) -> None:
        """Front end (replica 0), at shutdown: one last round that tells the other lockstep replicas to stop."""
        if self.dp_lockstep and not self.dp_stopped:
            self._dp_agree(None, stop=True)

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

    def _process(self, rows: list[Sequence], sampled: SamplerOutput) -> list[RequestOutput]:
        """Append each row's tokens (on the host) one by one, check stops, and build the outputs. A verification step
        (speculative decoding) emits a row's accepted drafts and one more token; a stop mid-proposal drops the rest."""
        spec = sampled.output_token_ids is not None
        emitted = (sampled.output_token_ids if spec else sampled.sampled_token_ids[:, None]).tolist()
        outputs, row = [], 0
        for seq, tokens in zip(rows, emitted):
            first, row = row, row + 1 + len(seq.spec_token_ids)  # its sampler rows: one per draft position
            if seq.is_finished:  # aborted, or stopped a step earlier (async scheduling): its tokens are dropped
                continue
            if spec:
                tokens = self._accept_drafts(seq, tokens)
            for j, token in enumerate(tokens):
                self._append(seq, token, sampled, first + j)
                if seq.is_finished:
                    break
            else:
                if spec:  # the rejected drafts' lookahead blocks go back; full blocks of accepted tokens get cached
                    self.scheduler.block_manager.trim(seq)
                    self.scheduler.block_manager.cache_full_blocks(seq)
            if seq.is_finished or seq.sampling_params.output_kind != RequestOutputKind.FINAL_ONLY:
                out = self._output(seq)
                if seq.parent is not None:  # a child: its output becomes its request's (None: siblings still run)
                    out = seq.parent.output(seq, out)
                    if seq.parent.finished:
                        self.parents.pop(seq.parent.request_id, None)
                if out is not None:
                    outputs.append(out)
            if seq.is_finished:
                self.requests.pop(seq.request_id, None)
        return outputs

    def _accept_drafts(self, seq: Sequence, emitted: list[int]) -> list[int]:
        """The tokens a verified row emits (its -1 padding cut); its accepted drafts' KV becomes computed."""
        tokens = emitted[:emitted.index(-1)] if -1 in emitted else emitted
        if k := len(seq.spec_token_ids):
            self.spec_stats.observe(k, len(tokens) - 1)
            seq.num_draft_tokens += k
            seq.num_accepted_tokens += len(tokens) - 1
        seq.num_computed_tokens += len(tokens) - 1
        seq.spec_token_ids = []
        return tokens

    def _append(self, seq: Sequence, token: int, sampled: SamplerOutput, row: int) -> None:
        seq.append_token(token)
        if seq.grammar is not None and not self.structured_output.accept_token(seq.grammar, token):
            logger.error("request %s: its grammar rejected the sampled token %d (a bug); the request ends",
                         seq.request_id, token)
            self.scheduler.finish(seq, "abort")
            return
        if seq.logprobs is not None:
            self._record_logprobs(seq, token, sampled, row)
        delta = ""
        if seq.detokenizer:
            delta = seq.detokenizer.add_token(token)
            seq.output_text = seq.detokenizer.output_text
        reason = self._check_stop(seq, token, delta)
        if reason is None:
            return
        if seq.detokenizer and not isinstance(seq.stop_reason, str):
            seq.detokenizer.flush()  # text held back for an unfinished UTF-8 char decodes as a full decode would
            seq.output_text = seq.detokenizer.output_text
        self.scheduler.finish(seq, reason)

    def _check_stop(self, seq: Sequence, token: int, delta: str) -> str | None:
        """"stop" / "length" if seq is done after `token` (setting stop_reason, cutting a stop string), else None."""
        params = seq.sampling_params
        if seq.grammar is not None and seq.grammar.is_terminated():
            # structured outputs: the grammar's end (its stop token accepted) is the output's end; min_tokens and
            # ignore_eos do not extend it (the grammar would allow nothing more)
            return "stop"
        if len(seq.output_token_ids) >= params.min_tokens:
            if token in self.eos_token_ids and not params.ignore_eos:
                return "stop"
            if token in params.stop_token_ids:
                seq.stop_reason = token
                return "stop"
            if params.stop_strings and delta:
                hit = find_stop_string(seq.output_text, len(delta), params.stop_strings, params.include_stop_str_in_output)
                if hit is not None:
                    seq.output_text, seq.stop_reason = hit
                    return "stop"
        if len(seq.output_token_ids) >= seq.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _record_logprobs(self, seq: Sequence, token: int, sampled: SamplerOutput, row: int) -> None:
        lp = float(sampled.sampled_logprobs[row])
        seq.cumulative_logprob += lp
        entry = {token: Logprob(lp, int(sampled.sampled_ranks[row]))}
        n = seq.sampling_params.logprobs
        if n and sampled.topk_token_ids is not None:
            ids = sampled.topk_token_ids[row, :n].tolist()
            lps = sampled.topk_logprobs[row, :n].tolist()
            for rank, (tid, tlp) in enumerate(zip(ids, lps), start=1):
                entry.setdefault(tid, Logprob(tlp, rank))
        if self.tokenizer is not None:
            for tid, logprob in entry.items():
                logprob.decoded_token = self.tokenizer.decode([tid])
        seq.logprobs.append(entry)

    def _output(self, seq: Sequence) -> RequestOutput:
        completion = CompletionOutput(
            index=seq.index, text=seq.output_text, token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=seq.logprobs, finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
        metrics = {} if self.proposer is None else {"spec_decode_num_draft_tokens": seq.num_draft_tokens,
                                                    "spec_decode_num_accepted_tokens": seq.num_accepted_tokens}
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion],
                             finished=seq.status == SequenceStatus.FINISHED, num_cached_tokens=seq.num_cached_tokens,
                             metrics=metrics)
