"""The compile pipeline: the one path from a model to what the model runner executes, for `LLM`, `graphinfer
compile` and artifacts alike.

  source   the checkpoint's model traced (compiler/trace.py) and run through the passes (PassManager), or an
           artifact's final weights and graph.py (compiler/artifact.py): CompiledModel.graph, what artifacts save
  lower    the platform's lowering steps, each graph -> graph and none saved: Inductor (cpu, kernels="inductor"),
           the skinny GEMM decode linears (compiler/skinny_gemm.py, measured), prepacked linears and bound op impls
           (cpu), torchair (npu_compiler): CompiledModel.executable, the one forward the runner runs, and
           CompiledModel.compute_logits, its LM head; CompiledModel.executable_rows, the same forward whose layers
           after the last attention run on the sampled rows only (compiler/sampled_rows.py)
  split    PIECEWISE modes: the executable's fx graph cut at the splitting ops (compiler/split.py)

The Worker (runtime/worker/worker.py) runs them in that order over a 1-block placeholder KV cache, then profiles the
executable, allocates the real cache (rebinding the graphs' buffer reads onto it) and captures device graphs.
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
from graphinfer.compiler.sampled_rows import sampled_rows_graph
from graphinfer.compiler.skinny_gemm import SkinnyGemmTable, event_timer, lower_skinny_gemm
from graphinfer.compiler.split import DEFAULT_SPLITTING_OPS, SplitGraph, split_graph
from graphinfer.compiler.trace import trace_model
from graphinfer.config import EngineConfig
from graphinfer.distributed import parallel_state as ps
from graphinfer.eplb import starting_placement
from graphinfer.errors import ArtifactMismatchError, InvalidConfigError
from graphinfer.model_loader import load_model
from graphinfer.models.loader import load_config, release_tensors
from graphinfer.models.parallel_layers import expert_placement, num_experts
from graphinfer.models.presets import PRESET_NAMES
from graphinfer.passes import PassReports, resolve_passes
from graphinfer.passes.base import PassReport
from graphinfer.lora.slots import fit_lora_slots
from graphinfer.passes.lora import LoRAPass
from graphinfer.passes.utils import release_fused_sources
from graphinfer.platforms import KernelBackend, Platform

logger = logging.getLogger(__name__)


@dataclass
class CompiledModel:
    model: nn.Module  # the module tree (weights, KV-cache buffers) every graph below runs over
    hf_config: object
    graph: nn.Module  # the fused forward: an fx.GraphModule from the passes, or an artifact's graph.py module
    pass_reports: PassReports
    capture_sizes: list[int]
    executable: Callable | None = None  # lower: the forward the runner runs (graph, lowered for the platform)
    compute_logits: Callable | None = None  # lower: the LM head the runner runs (cpu: on packed weights)
    # lower: the executable with logits_indices as a 4th input, the layers after the last attention run on those rows
    # only (compiler/sampled_rows.py); None where it cannot be cut or is not an fx graph run eagerly
    executable_rows: fx.GraphModule | None = None
    skinny_gemm: SkinnyGemmTable | None = None  # decode linears on the skinny GEMM kernel where measured faster
    split: SplitGraph | None = None  # PIECEWISE modes: the executable's fx graph cut at the splitting ops

    def release(self, tensors: bool = False) -> None:
        """Break each fx graph's cycle with its module (so they go with the last reference, without a garbage
        collection); tensors: also free the weights, including those of modules something else still refers to."""
        graphs = {id(g): g for g in (self.graph, self.executable, self.executable_rows)
                  if isinstance(g, fx.GraphModule)}
        for gm in graphs.values():
            gm.graph.owning_module = None
        for module in (self.graph, self.model) if tensors else ():
            if isinstance(module, nn.Module):
                release_tensors(module)


class CompilePipeline:
    def __init__(self, config: EngineConfig, platform: Platform, backend: KernelBackend, device: torch.device,
                 capture_sizes: list[int],
                 phase: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext()):
        """backend: what platform.activate(kernels) returned; phase(name): a context that times one start-up phase
        (runtime/startup_timer.py)."""
        self.config, self.platform, self.backend, self.device, self.phase = config, platform, backend, device, phase
        self.capture_sizes = capture_sizes
        self.manifest = artifact.read_manifest(config.artifact) if config.artifact else None
        if self.manifest is not None and envs.GRAPHINFER_KERNEL_CACHE != "off":
            kernel_cache.use(config.artifact, device)  # before any kernel compiles

    # ----- source -----
    def load(self) -> CompiledModel:
        """The weights and the fused graph: an artifact's (checked against its manifest), else the checkpoint's model
        traced and optimised by the passes."""
        mc = self.config.model_config
        with self.phase("weights"):
            if self.manifest is None:
                rows = eplb_rows(self.config)
                with expert_placement(rows) as placement:
                    model, hf_config = load_model(mc.model, mc.torch_dtype, self.device, mc.seed, mc.quantization,
                                                  mc.model_impl)
                if rows and len(rows) > 1 and placement.used != len(rows):
                    raise InvalidConfigError(f"expert map {self.config.parallel_config.expert_map_path}: it places "
                                             f"{len(rows)} MoE layers, the model has {placement.used}.")
            else:
                model, hf_config = self._load_artifact_model()
        model.requires_grad_(False)  # inference only; a trace (the cpu decode graphs) keeps no grad-requiring weights
        with self.phase("graph"):
            if self.manifest is not None:
                graph = artifact.load_graph(self.config.artifact, self.manifest, model)
                reports = artifact.load_reports(self.manifest)
                self._fit_lora_slots(graph)
            else:
                graph, reports = self._run_passes(model)
        return CompiledModel(model, hf_config, graph, reports, self.capture_sizes)

    def _run_passes(self, model: nn.Module):
        """The passes run and checked (compile_model). A pass whose own check fails is declined, as a pass declines
        a match it cannot make safely: the graph is compiled again without it, the reason logged and recorded in its
        report (matches 0, unchecked, the failure in `declined`), unless compile_config.keep_failed_passes (then the
        failed graph runs, with a warning; `graphinfer compile` sets it and refuses or overrides by its own check)."""
        passes = configured_passes(self.config)
        dropped: dict[str, str] = {}  # pass name -> why its check failed
        while True:
            graph, reports = compile_model(model, passes)
            if self.config.compile_config.keep_failed_passes:
                break
            failed = {r.name: r.check.why() for r in reports if r.check is not None and not r.check.passed}
            # every tensor-parallel rank drops the same passes (a check on one rank's shard may fail alone)
            for rank, found in enumerate(ps.all_gather_object(failed)):
                for name, why in found.items():
                    failed.setdefault(name, why if rank == ps.tp_rank() else f"on rank {rank}: {why}")
            if not failed:
                break
            for name, why in failed.items():
                dropped[name] = why
                logger.warning("pass %s declined: its numeric check failed (%s); the model is compiled without it "
                               "(keep_failed_passes=True runs it anyway)", name, why)
            kept = [p for p in passes if (p.name or type(p).__name__) not in failed]
            if len(kept) == len(passes):  # nothing left to drop (cannot happen: the failed reports name passes run)
                break
            passes = kept
        if dropped:
            reports = _with_declined(reports, configured_passes(self.config), dropped)
        if not reports.passed:  # `compile` refuses such a graph; here it runs, loudly
            logger.warning("passes changed the model's outputs beyond the check's tolerances: %s",
                           "; ".join(reports.failures()))
        release_fused_sources(model, graph.meta.get("fused_linears", {}))
        return graph, reports

    def _fit_lora_slots(self, graph: nn.Module) -> None:
        """An artifact's LoRA slots (saved empty) sized for this engine; without enable_lora, one rank-1 slot no token
        uses. enable_lora on an artifact compiled without it is refused."""
        lc = self.config.lora_config
        on = lc.enable_lora
        found = fit_lora_slots(graph, lc.max_loras if on else 1, lc.max_lora_rank if on else 1,
                               lora_max_num_tokens(self.config), self.device)
        if on and not found:
            raise ArtifactMismatchError(
                f"Artifact {self.config.artifact!r} was compiled without LoRA, so it has no adapter slots; serve it "
                f"without enable_lora (--enable-lora), or recompile: graphinfer compile "
                f"{self.manifest['model']['path']} -o {self.config.artifact} --enable-lora")

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
        # (cpu: traced at start-up, the decode graphs leave the artifact as it is in every mode)
        if manifest["platform"] != "cpu" and manifest["graph_mode"] != self.config.compile_config.graph_mode:
            raise ArtifactMismatchError(f"Artifact {art!r} was compiled for graph_mode={manifest['graph_mode']!r}; "
                                        f"run it with that mode or recompile.")
        compiled_q = (manifest.get("quantization") or {}).get("method")
        if mc.quantization is not None and mc.quantization != compiled_q:  # its weights were fixed at compile time
            raise ArtifactMismatchError(
                f"Artifact {art!r} was compiled with quantization={compiled_q!r}, but quantization="
                f"{mc.quantization!r} was asked. Leave quantization unset (-q) to serve it as compiled, or recompile: "
                f"graphinfer compile {manifest['model']['path']} -o {art} -q {mc.quantization}")
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

    # ----- lower, split -----
    def lower(self, c: CompiledModel) -> None:
        """c.executable and c.compute_logits: the platform's lowering steps, in order (the saved graph stays as the
        passes left it)."""
        backend = self.backend
        executable = c.graph
        if backend.graph_compiler == "inductor":
            from graphinfer.compiler.inductor import compile_for_cpu, warm_up  # imports Inductor: only when used

            executable = compile_for_cpu(_fx(c.graph))
            warm_up(executable, self.device)  # compile (or load from Inductor's cache) at start-up
        if backend.skinny_gemm:
            with self.phase("skinny gemm (measure)"):
                timer = event_timer(self.platform.device_module) if self.device.type != "cpu" else None
                c.skinny_gemm, executable = lower_skinny_gemm(_fx(c.graph), self.config.scheduler_config.max_num_seqs,
                                                              timer)
        c.compute_logits = c.model.compute_logits
        if backend.prepacked_linears:
            executable = pack_linears(_fx(executable))
            c.compute_logits = packed_lm_head(c.model) or c.compute_logits
        rows = None
        if isinstance(executable, fx.GraphModule) and backend.graph_compiler != "inductor":
            rows, why = sampled_rows_graph(executable)
            logger.info("sampled-rows forward: %s", why)
        if backend.binds_op_impls:
            executable = bind_op_impls(_fx(executable), backend.op_impls)
            rows = rows and bind_op_impls(rows, backend.op_impls, in_place=True)
        if (spec := self.config.compile_config.npu_compiler):
            executable, rows = self._torchair(c.graph, spec), None
        c.executable, c.executable_rows = executable, rows

    def split(self, c: CompiledModel) -> None:
        """c.split: the executable cut at the splitting ops, for piecewise capture."""
        cc = self.config.compile_config
        c.split = split_graph(_fx(c.executable if c.skinny_gemm is not None else c.graph),
                              cc.splitting_ops or DEFAULT_SPLITTING_OPS)
        logger.info("split: %s", c.split.info.summary())

    def _torchair(self, graph: nn.Module, spec: str):
        """The fused graph handed to torchair (it captures ACL graphs itself)."""
        from graphinfer.compiler.torchair_backend import compile_with_torchair

        if self.platform.name != "npu":
            raise InvalidConfigError(f"npu_compiler={spec!r} needs the npu platform; this engine runs on "
                                     f"{self.platform.name}. Drop npu_compiler or use device='npu'.")
        return compile_with_torchair(graph, spec.partition(":")[2] or "npugraph_ex", kernels=self.platform.kernels)


def eplb_rows(config: EngineConfig) -> list[list[int]] | None:
    """The physical expert placement this rank's MoE layers are built with (models/parallel_layers.expert_placement):
    EPLB's or an expert map's, under expert parallel; None: the plain contiguous layout."""
    pc = config.parallel_config
    if not (pc.enable_eplb or pc.expert_map_path) or ps.ep_size() == 1:
        return None
    return starting_placement(num_experts(load_config(config.model_config.model)),
                              pc.eplb_config.num_redundant_experts, ps.ep_size(), pc.expert_map_path)


def lora_max_num_tokens(config: EngineConfig) -> int:
    """The most tokens one forward runs: the LoRA index buffer's length (a step, or the largest captured graph)."""
    spec = config.speculative_config
    per_row = 1 + (spec.num_speculative_tokens if spec is not None else 0)
    return max(config.scheduler_config.max_num_batched_tokens, config.compile_config.max_capture_size * per_row)


_AFTER_LORA = ("fuse_add_rmsnorm", "fuse_allreduce_add_rmsnorm", "fuse_moe", "absorb_mla", "lower_quant_linears",
               "fuse_rmsnorm_quant", "fuse_silu_mul_quant", "cleanup")


def configured_passes(config: EngineConfig) -> list:
    """The configured passes; with enable_lora, the lora pass among them (added, if the list lacks it, after the
    projections are fused and before anything fuses around their outputs: the all-reduce of a row-parallel layer must
    still follow its F.linear, and quantized linears are not lowered yet) with the slots' sizes."""
    passes = resolve_passes(config.compile_config.passes)
    lc = config.lora_config
    if lc.enable_lora and config.model_config.quantization and config.parallel_config.tensor_parallel_size > 1:
        raise InvalidConfigError(
            f"enable_lora with quantization={config.model_config.quantization!r} at tensor_parallel_size > 1 is not "
            f"supported: the lora pass finds a row-parallel projection by its F.linear before the all-reduce, and a "
            f"quantized one is traced to its quantized ops. Use tensor_parallel_size=1, or an unquantized model.")
    if lc.enable_lora:
        lora = next((p for p in passes if isinstance(p, LoRAPass)), None)
        if lora is None:
            names = [p.name for p in passes]
            at = next((i for i, n in enumerate(names) if n in _AFTER_LORA), len(passes))
            lora = LoRAPass()
            passes.insert(at, lora)
        lora.max_loras, lora.max_lora_rank = lc.max_loras, lc.max_lora_rank
        lora.max_num_tokens = lora_max_num_tokens(config)
    return passes


def _with_declined(reports: PassReports, passes: list, dropped: dict[str, str]) -> PassReports:
    """reports with a report for each dropped pass at its place in the configured order: no matches, unchecked, and
    why it was declined."""
    ran = {r.name: r for r in reports}
    out = []
    for p in passes:
        name = p.name or type(p).__name__
        if name in dropped:
            out.append(PassReport(name, 0, 0, 0, 0.0, None, [
                f"declined: its numeric check failed ({dropped[name]}); the graph was compiled without it"]))
        elif name in ran:
            out.append(ran.pop(name))
    out.extend(ran.values())
    return PassReports(out, reports.end_to_end)


def _fx(graph: nn.Module) -> fx.GraphModule:
    """graph as an fx graph: an artifact's graph.py module is re-traced (the same nodes; no passes run)."""
    return graph if isinstance(graph, fx.GraphModule) else trace_model(graph)
