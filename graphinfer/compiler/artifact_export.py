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
    mc = config.model_config
    artifact.prepare_dir(out_dir, c.graph, c.model)
    (write_ranks or (lambda d: write_rank_files(d, c)))(out_dir)
    return artifact.save_artifact(
        out_dir, c.graph, reports, fingerprint=model_fingerprint(mc.model, c.hf_config, mc.seed),
        device=device, dtype=mc.torch_dtype, graph_mode=config.compile_config.graph_mode,
        capture_sizes=c.capture_sizes, split=c.split.info if c.split is not None else None,
        model=c.model, hf_config=c.hf_config, tokenizer=tokenizer, check=check,
        tensor_parallel_size=config.parallel_config.tensor_parallel_size,
        expert_parallel=any(getattr(m, "ep_size", 1) > 1 for m in c.model.modules()),
        quantization=mc.quantization,
        speculative_config=dataclasses.asdict(spec) if (spec := config.speculative_config) else None,
        model_impl="transformers" if isinstance(c.model, TransformersForCausalLM) else "graphinfer")


def write_rank_files(out_dir: str, c: CompiledModel) -> None:
    """Write this rank's weights (and what passes added) into out_dir (every rank at once: export_artifact's
    write_ranks), then wait for every rank's. That wait is what orders the other ranks' writes before rank 0
    hashes their files: a collective that gathers each rank's failure, if any (a rank that failed joins it too, so
    none waits forever), and the digest of its graph code, which must be rank 0's: graph.py is written once, for
    all."""
    error = None
    try:
        artifact.save_rank_files(out_dir, c.graph, c.model, ps.tp_rank(), ps.tp_size())
    except Exception as e:  # rank 0 raises it, below
        error = e
    digest = hashlib.sha256(artifact.graph_source(c.graph).encode()).hexdigest()
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
