"""Writing a CompiledModel as a `graphinfer compile` artifact (compiler/artifact.py holds the format): the pass
checks judged at the asked tolerances, every tensor-parallel rank's files, then rank 0's graph, config, tokenizer,
report and manifest."""
import dataclasses
import hashlib
from collections.abc import Callable

import torch
from torch import fx

from graphinfer.compiler import artifact
from graphinfer.compiler.fingerprint import model_fingerprint
from graphinfer.compiler.pipeline import CompiledModel
from graphinfer.config import EngineConfig
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import GraphinferError, InvalidConfigError
from graphinfer.models.pipeline_stage import stage_layer_counts
from graphinfer.models.transformers import TransformersForCausalLM
from graphinfer.passes import PassCheckError


def export_artifact(out_dir: str, c: CompiledModel, config: EngineConfig, tokenizer, device: torch.device, *,
                    atol: float | None = None, rtol: float | None = None, allow_check_failure: bool = False,
                    write_ranks: Callable[[str], None] | None = None) -> dict:
    """Write c as an artifact into out_dir; returns its manifest. Refused (PassCheckError) when a pass, or the
    pipeline end to end, fails its numeric check at atol / rtol (None: the dtype's defaults), unless
    allow_check_failure, which the manifest then records. write_ranks(out_dir): has every tensor-parallel rank write
    its shard (write_rank_files on each, together; default: this rank's alone)."""
    if not isinstance(c.graph, fx.GraphModule):
        raise InvalidConfigError("This engine runs a loaded artifact; compile from the model to write a new one.")
    if config.parallel_config.enable_eplb or config.parallel_config.expert_map_path:
        raise InvalidConfigError("An artifact's experts are laid out for the plain placement: compile without "
                                 "enable_eplb / expert_map_path, and serve the checkpoint with them.")
    reports = c.pass_reports.rejudge(atol, rtol)
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
    mc, pc = config.model_config, config.parallel_config
    if pc.pipeline_parallel_size > 1 and mc.quantization:
        raise InvalidConfigError(f"graphinfer compile with pipeline_parallel_size={pc.pipeline_parallel_size} and "
                                 f"quantization={mc.quantization!r} is not supported yet: compile without -pp, or "
                                 f"serve the checkpoint with both.")
    artifact.prepare_dir(out_dir, c.graph, c.model)
    fused_linears = (write_ranks or (lambda d: write_rank_files(d, c)))(out_dir)
    return artifact.save_artifact(
        out_dir, c.graph, reports, fingerprint=model_fingerprint(mc.model, c.hf_config, mc.seed),
        device=device, dtype=mc.torch_dtype, graph_mode=config.compile_config.graph_mode,
        capture_sizes=c.capture_sizes, split=c.split.info if c.split is not None else None,
        model=c.model, hf_config=c.hf_config, tokenizer=tokenizer, check=check,
        tensor_parallel_size=pc.tensor_parallel_size, pipeline_parallel_size=pc.pipeline_parallel_size,
        pp_layer_partition=stage_layer_counts(c.hf_config.num_hidden_layers, pc.pipeline_parallel_size,
                                              pc.pp_layer_partition) if pc.pipeline_parallel_size > 1 else None,
        fused_linears=fused_linears,
        expert_parallel=any(getattr(m, "ep_size", 1) > 1 for m in c.model.modules()),
        quantization=mc.quantization,
        speculative_config=dataclasses.asdict(spec) if (spec := config.speculative_config) else None,
        model_impl="transformers" if isinstance(c.model, TransformersForCausalLM) else "graphinfer")


def write_rank_files(out_dir: str, c: CompiledModel) -> dict | None:
    """Write this rank's weights (and what passes added) into out_dir (every rank at once: export_artifact's
    write_ranks), then wait for every rank's. That wait is what orders the other ranks' writes before rank 0
    hashes their files: a collective that gathers each rank's failure, if any (a rank that failed joins it too, so
    none waits forever), and the digest of its graph code, which must be its stage's TP rank 0's: graph.py is
    written once for all (pipeline parallel: once per stage, by that rank). Returns, on rank 0, every stage's fused
    projections (manifest "fused_linears")."""
    error = None
    source = artifact.graph_source(c.graph)
    try:
        artifact.save_rank_files(out_dir, c.graph, c.model, ps.replica_rank(), ps.replica_size())
        if ps.pp_size() > 1 and ps.tp_rank() == 0:
            with open(f"{out_dir}/{artifact.stage_graph_file(ps.pp_rank(), ps.pp_size())}", "w") as f:
                f.write(source)
    except Exception as e:  # rank 0 raises it, below
        error = e
    digest = hashlib.sha256(source.encode()).hexdigest()
    ranks = ps.all_gather_object((None if error is None else f"{type(error).__name__}: {error}", digest,
                                  c.graph.meta.get("fused_linears", {})))
    if ps.replica_rank() > 0:
        return None
    if error is not None:
        raise error
    if failed := [f"rank {r}: {e}" for r, (e, _, _) in enumerate(ranks) if e is not None]:
        raise GraphinferError(f"Not every rank could write its files into {out_dir!r}, so the artifact is "
                              f"incomplete:\n  " + "\n  ".join(failed))
    tp = ps.tp_size()
    if differ := [r for r, (_, d, _) in enumerate(ranks) if d != ranks[r - r % tp][1]]:
        raise GraphinferError(f"Ranks {differ} compiled other graph code than their stage's rank 0, so one graph.py "
                              f"cannot serve them all; a layer puts rank-dependent values into the graph (a bug: keep "
                              f"them in buffers, as VocabParallelEmbedding does).")
    return {k: v for _, _, fused in ranks for k, v in fused.items()}
