"""The compile pipeline: the one path from a model to what the model runner executes, for `LLM`, `graphinfer
compile` and artifacts alike.

  source   the checkpoint's model traced (compiler/trace.py) and run through the passes (PassManager), or an
           artifact's final weights and graph.py (compiler/artifact.py): CompiledModel.graph, what artifacts save
  lower    the platform's lowering steps, each graph -> graph and none saved: Inductor (cpu, kernels="inductor"),
           the skinny GEMM decode linears (compiler/skinny_gemm.py, measured), torchair (npu_compiler):
           CompiledModel.executable, the one forward the runner runs
  split    PIECEWISE modes: the executable's fx graph cut at the splitting ops (compiler/split.py)
  capture  the runner's kernels warmed, then its device graphs recorded per bucket: full decode (and verify) graphs,
           then the pieces. What to record, in which order and within which budget is decided here; how to record
           and replay is the runner's (runtime/device_graphs.py, runtime/piecewise_graphs.py), which this module
           does not import: `finish` takes the runner as an argument.

The KV cache is sized from the memory the weights and graph took, so the engine calls `load`, builds its runner
(allocating the cache), then `finish(compiled, runner, ...)`.
"""
import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import fx, nn

from graphinfer import envs
from graphinfer.compiler import artifact, kernel_cache
from graphinfer.compiler.compile import compile_model
from graphinfer.compiler.bind_ops import bind_op_impls
from graphinfer.compiler.cpu_packed_linear import pack_linears, packed_lm_head
from graphinfer.compiler.fingerprint import model_fingerprint
from graphinfer.compiler.skinny_gemm import SkinnyGemmTable, event_timer, lower_skinny_gemm
from graphinfer.compiler.split import DEFAULT_SPLITTING_OPS, SplitGraph, split_graph
from graphinfer.compiler.trace import rebind_buffers, trace_model
from graphinfer.config import FULL_GRAPH_MODES, PIECEWISE_GRAPH_MODES, EngineConfig, default_capture_sizes
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import ArtifactMismatchError, InvalidConfigError
from graphinfer.model_loader import load_model
from graphinfer.models.loader import load_config, release_tensors
from graphinfer.models.presets import PRESET_NAMES
from graphinfer.passes import PassReports, resolve_passes
from graphinfer.passes.utils import release_fused_sources
from graphinfer.platforms import Platform

logger = logging.getLogger(__name__)


@dataclass
class CompiledModel:
    model: nn.Module  # the module tree (weights, KV-cache buffers) every graph below runs over
    hf_config: object
    graph: nn.Module  # the fused forward: an fx.GraphModule from the passes, or an artifact's graph.py module
    pass_reports: PassReports
    capture_sizes: list[int]
    executable: Callable | None = None  # finish: the forward the runner runs (graph, lowered for the platform)
    skinny_gemm: SkinnyGemmTable | None = None  # decode linears on the skinny GEMM kernel where measured faster
    split: SplitGraph | None = None  # PIECEWISE modes: the executable's fx graph cut at the splitting ops
    capture_stats: object = None  # the runner's CaptureStats of the decode graphs, of the pieces
    piecewise_capture_stats: object = None

    def release(self, tensors: bool = False) -> None:
        """Break each fx graph's cycle with its module (so they go with the last reference, without a garbage
        collection); tensors: also free the weights, including those of modules something else still refers to."""
        graphs = {id(g): g for g in (self.graph, self.executable) if isinstance(g, fx.GraphModule)}
        for gm in graphs.values():
            gm.graph.owning_module = None
        for module in (self.graph, self.model) if tensors else ():
            if isinstance(module, nn.Module):
                release_tensors(module)


class CompilePipeline:
    def __init__(self, config: EngineConfig, platform: Platform, device: torch.device,
                 phase: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext()):
        """phase(name): a context that times one start-up phase (runtime/startup_timer.py)."""
        self.config, self.platform, self.device, self.phase = config, platform, device, phase
        comp = config.compile_config
        if comp.graph_mode is None:
            comp.graph_mode = platform.default_graph_mode(comp.kernels)
        self._check_graph_mode()
        self.capture_sizes = comp.capture_sizes or default_capture_sizes(comp.max_capture_size)  # derived in config
        self.manifest = artifact.read_manifest(config.artifact) if config.artifact else None
        if self.manifest is not None and envs.GRAPHINFER_KERNEL_CACHE != "off":
            kernel_cache.use(config.artifact, device)  # before any kernel compiles

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

    # ----- source -----
    def load(self) -> CompiledModel:
        """The weights and the fused graph: an artifact's (checked against its manifest), else the checkpoint's model
        traced and optimised by the passes."""
        mc = self.config.model_config
        with self.phase("weights"):
            if self.manifest is None:
                model, hf_config = load_model(mc.model, mc.torch_dtype, self.device, mc.seed, mc.quantization)
            else:
                model, hf_config = self._load_artifact_model()
        with self.phase("graph"):
            if self.manifest is not None:
                graph = artifact.load_graph(self.config.artifact, self.manifest, model)
                reports = artifact.load_reports(self.manifest)
            else:
                graph, reports = self._run_passes(model)
        return CompiledModel(model, hf_config, graph, reports, self.capture_sizes)

    def _run_passes(self, model: nn.Module):
        graph, reports = compile_model(model, resolve_passes(self.config.compile_config.passes))
        if not reports.passed:  # `compile` refuses such a graph; here it runs, loudly
            logger.warning("passes changed the model's outputs beyond the check's tolerances: %s",
                           "; ".join(reports.failures()))
        release_fused_sources(model, graph.meta.get("fused_linears", {}))
        return graph, reports

    def _load_artifact_model(self):
        """(model, hf_config) with the artifact's final weights, checked against its manifest and against the model
        named with it, if any."""
        mc, art, manifest = self.config.model_config, self.config.artifact, self.manifest
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

    # ----- lower, split, capture -----
    def finish(self, c: CompiledModel, runner, max_model_len: int, num_speculative_tokens: int | None) -> None:
        """Lower c.graph into c.executable, which `runner` (runtime/model_runner.py, its KV cache allocated) runs from
        here on; warm its kernels; split and capture its device graphs as the graph mode says."""
        comp = self.config.compile_config
        if isinstance(c.graph, fx.GraphModule):
            rebind_buffers(c.graph, c.model)  # onto the runner's KV cache
        runner.graph = c.executable = self._lower(c)
        if self.platform.prepacks_linear_weights(comp.kernels):
            runner.compute_logits = packed_lm_head(c.model) or runner.compute_logits
        if self.device.type != "cpu":  # cpu: Inductor warmed itself, or there is nothing to compile
            with self.phase("kernels"):  # compiles (or loads from the kernel cache) the prefill path's kernels
                runner.warm_up(speculative=num_speculative_tokens is not None)
        capture = not self.config.compile_only or self.device.type != "cpu"  # compile on a GPU: warm every bucket
        if comp.graph_mode in FULL_GRAPH_MODES and capture:
            with self.phase("capture (decode graphs)"):
                c.capture_stats = runner.capture_decode_graphs(self._decode_sizes(), max_model_len, comp.capture_lm_head)
            if num_speculative_tokens is not None:  # uniform 1 + k token verification steps
                with self.phase("capture (verify graphs)"):
                    runner.capture_decode_graphs(self._decode_sizes(), max_model_len, comp.capture_lm_head,
                                                 query_len=1 + num_speculative_tokens)
        if comp.graph_mode in PIECEWISE_GRAPH_MODES:
            c.split = split_graph(_fx(c.executable if c.skinny_gemm is not None else c.graph),
                                  comp.splitting_ops or DEFAULT_SPLITTING_OPS)
            logger.info("split: %s", c.split.info.summary())
            if capture:
                with self.phase("capture (piecewise graphs)"):
                    c.piecewise_capture_stats = runner.capture_piecewise_graphs(
                        c.split, self._piecewise_sizes(c.split.info.num_pieces))

    def _lower(self, c: CompiledModel) -> Callable:
        """The platform's lowering steps, in order (the saved graph stays as the passes left it)."""
        comp, platform = self.config.compile_config, self.platform
        executable = c.graph
        if platform.graph_compiler(comp.kernels) == "inductor":
            from graphinfer.compiler.inductor import compile_for_cpu, warm_up  # imports Inductor: only when used

            executable = compile_for_cpu(_fx(c.graph))
            warm_up(executable, self.device)  # compile (or load from Inductor's cache) at start-up
        if platform.supports_skinny_gemm(comp.kernels):
            with self.phase("skinny gemm (measure)"):
                timer = event_timer(platform.device_module) if self.device.type != "cpu" else None
                c.skinny_gemm, executable = lower_skinny_gemm(_fx(c.graph), self.config.scheduler_config.max_num_seqs,
                                                              timer)
        if platform.prepacks_linear_weights(comp.kernels):
            executable = pack_linears(_fx(executable))
        if platform.binds_op_impls(comp.kernels):
            executable = bind_op_impls(_fx(executable), platform.op_impls(comp.kernels))
        if comp.npu_compiler:
            executable = self._torchair(c.graph, comp.npu_compiler)
        return executable

    def _torchair(self, graph: nn.Module, spec: str):
        """The fused graph handed to torchair (it captures ACL graphs itself)."""
        from graphinfer.compiler.torchair_backend import compile_with_torchair

        if self.platform.name != "npu":
            raise InvalidConfigError(f"npu_compiler={spec!r} needs the npu platform; this engine runs on "
                                     f"{self.platform.name}. Drop npu_compiler or use device='npu'.")
        return compile_with_torchair(graph, spec.partition(":")[2] or "npugraph_ex", kernels=self.platform.kernels)

    def _decode_sizes(self) -> list[int]:
        """Full decode graphs: the capture sizes a decode batch can have (at most max_num_seqs rows)."""
        mns = self.config.scheduler_config.max_num_seqs
        return [s for s in self.capture_sizes if s <= mns] or [min(self.capture_sizes)]

    def _piecewise_sizes(self, num_pieces: int) -> list[int]:
        """Piecewise graphs: the capture sizes a step can have (at most max_num_batched_tokens tokens), within the
        platform's graph budget (Ascend: its streams) after the full decode graphs took theirs."""
        mbt = self.config.scheduler_config.max_num_batched_tokens
        sizes = [s for s in self.capture_sizes if s <= mbt] or [min(self.capture_sizes)]
        budget = self.platform.capture_budget(int(ps.tp_size() > 1), num_pieces)  # Ascend: HCCL takes streams too
        if budget is None:
            return sizes
        if self.config.compile_config.graph_mode in FULL_GRAPH_MODES:
            budget -= len(self._decode_sizes())
        return fit_graph_budget(sizes, num_pieces, budget)


def _fx(graph: nn.Module) -> fx.GraphModule:
    """graph as an fx graph: an artifact's graph.py module is re-traced (the same nodes; no passes run)."""
    return graph if isinstance(graph, fx.GraphModule) else trace_model(graph)


def fit_graph_budget(sizes: list[int], graphs_per_size: int, budget: int) -> list[int]:
    """The capture sizes whose graphs fit `budget` (Ascend's stream budget, as vllm-ascend's
    update_aclgraph_sizes computed it): all of them if they fit, else as many as fit, spread evenly over the
    list with the smallest and the largest kept, and a warning that says how many were kept and why."""
    sizes = sorted(set(sizes))
    keep = max(1, budget // max(1, graphs_per_size))
    if len(sizes) <= keep:
        return sizes
    kept = sorted({sizes[round(i * (len(sizes) - 1) / max(1, keep - 1))] for i in range(keep)})
    logger.warning("Capturing %d of %d piecewise sizes: each costs %d graphs (one per piece) and the platform can "
                   "capture %d graphs in all; kept %s. Lower max_capture_size or give capture_sizes to choose.",
                   len(kept), len(sizes), graphs_per_size, budget, kept)
    return kept
