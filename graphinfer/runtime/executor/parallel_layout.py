"""Refusals of a tensor / expert / data-parallel layout, with the numbers, before any rank or replica starts."""
from graphinfer.compiler import artifact
from graphinfer.eplb import starting_placement
from graphinfer.config import EngineConfig
from graphinfer.errors import ArtifactMismatchError, InvalidConfigError
from graphinfer.models import resolve_model_impl
from graphinfer.models.loader import load_config
from graphinfer.models.parallel_layers import check_tensor_parallel, num_experts, uses_expert_parallel
from graphinfer.models.pipeline_stage import stage_layer_counts
from graphinfer.models.transformers_tp import tp_plan


def model_config_of(config: EngineConfig):
    return artifact.load_config(config.artifact) if config.artifact else load_config(config.model_config.model)


def expert_parallel_size(config: EngineConfig) -> int:
    """The EP size: tp x dp with expert parallel on (and experts to split), else 1."""
    pc = config.parallel_config
    return pc.world_size if uses_expert_parallel(model_config_of(config), pc.world_size,
                                                  pc.enable_expert_parallel) else 1


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
    if pc.pipeline_parallel_size > 1:
        check_pipeline_parallel(config, model)
    if pc.tensor_parallel_size > 1 and not config.artifact and \
            resolve_model_impl(model.architectures, config.model_config.model_impl) == "transformers":
        tp_plan(model)  # refuses a config without one
    if pc.enable_eplb or pc.expert_map_path:
        check_eplb(config, model)
    if config.artifact and pc.data_parallel_size > 1 and uses_expert_parallel(model, pc.world_size,
                                                                               pc.enable_expert_parallel):
        raise InvalidConfigError(
            f"Artifact {config.artifact!r}: expert parallel over data_parallel_size={pc.data_parallel_size} replicas "
            f"runs from the checkpoint for now (an artifact's experts are laid out over its tensor-parallel ranks "
            f"only): serve the model's checkpoint with --data-parallel-size {pc.data_parallel_size} "
            f"--enable-expert-parallel, or leave data parallel off.")


def check_eplb(config: EngineConfig, model) -> None:
    """Refuse EPLB / an expert map where it cannot work: an artifact (its experts' layout is fixed), a dense model,
    a redundancy the EP ranks cannot split, a bad expert-map file."""
    pc = config.parallel_config
    what = "enable_eplb" if pc.enable_eplb else "expert_map_path"
    if config.artifact:
        raise InvalidConfigError(f"{what} with artifact {config.artifact!r}: an artifact's expert weights are laid out "
                                 f"for its plain placement; serve the model's checkpoint with EPLB instead.")
    if not num_experts(model):
        raise InvalidConfigError(f"{what}: {config.model_config.model} is a dense model (no routed experts to "
                                 f"balance); leave EPLB off.")
    starting_placement(num_experts(model), pc.eplb_config.num_redundant_experts, pc.world_size, pc.expert_map_path)


def check_pipeline_parallel(config: EngineConfig, model) -> None:
    """Refuse, naming the flag, what pipeline parallel does not run with yet, and a layer partition that does not fit
    the model."""
    pc = config.parallel_config
    pp = pc.pipeline_parallel_size
    stage_layer_counts(model.num_hidden_layers, pp, pc.pp_layer_partition)
    refused = [("--data-parallel-size", pc.data_parallel_size > 1),
               ("--enable-expert-parallel", pc.enable_expert_parallel),
               ("--speculative-config", config.speculative_config is not None),
               ("--enable-lora", config.lora_config.enable_lora),
               ("--async-scheduling (pipeline parallel keeps its own batches in flight)",
                config.scheduler_config.async_scheduling),
               ("--model-impl transformers", not config.artifact and resolve_model_impl(
                   model.architectures, config.model_config.model_impl) == "transformers")]
    for flag, on in refused:
        if on:
            raise InvalidConfigError(f"pipeline_parallel_size={pp} does not run with {flag} yet: drop one of them.")


def check_artifact_parallel(config: EngineConfig) -> None:
    """Refuse an artifact compiled for another tensor-parallel size or expert-parallel setting (its weights are
    laid out for that) before starting any rank."""
    art, tp = config.artifact, config.parallel_config.tensor_parallel_size
    manifest = artifact.read_manifest(art)
    pp, compiled_pp = config.parallel_config.pipeline_parallel_size, artifact.pipeline_parallel_size(manifest)
    if pp != compiled_pp:
        raise ArtifactMismatchError(
            f"Artifact {art!r} was compiled for pipeline_parallel_size={compiled_pp}, but this engine runs "
            f"pipeline_parallel_size={pp} (each stage's graph and weights are its own). Run it with "
            f"--pipeline-parallel-size {compiled_pp} (LLM(pipeline_parallel_size={compiled_pp})), or recompile it "
            f"for {pp}: graphinfer compile {manifest['model']['path']} -o {art} --pipeline-parallel-size {pp}"
            + (f" --tensor-parallel-size {tp}" if tp > 1 else ""))
    partition = manifest.get("pp_layer_partition")
    if pp > 1 and partition and stage_layer_counts(sum(partition), pp, config.parallel_config.pp_layer_partition) \
            != partition:
        raise ArtifactMismatchError(
            f"Artifact {art!r} was compiled with pp_layer_partition={','.join(map(str, partition))}, but this "
            f"engine asks for {config.parallel_config.pp_layer_partition!r}: leave --pp-layer-partition unset (the "
            f"artifact's is used), or recompile with the one you want.")
    compiled = artifact.tensor_parallel_size(manifest)
    if compiled != tp:
        raise ArtifactMismatchError(
            f"Artifact {art!r} was compiled for tensor_parallel_size={compiled}, but this engine runs "
            f"tensor_parallel_size={tp}. Run it with --tensor-parallel-size {compiled} (LLM(tensor_parallel_size="
            f"{compiled})), or recompile it for {tp}: graphinfer compile {manifest['model']['path']} -o {art} "
            f"--tensor-parallel-size {tp}")
    ep = uses_expert_parallel(model_config_of(config), tp, config.parallel_config.enable_expert_parallel)
    if ep != (compiled := artifact.expert_parallel(manifest)):
        state = {True: "on", False: "off"}
        run = "with" if compiled else "without"
        raise ArtifactMismatchError(
            f"Artifact {art!r} was compiled with expert parallel {state[compiled]}, but this engine runs it "
            f"{state[ep]} (the experts are laid out over the ranks differently). Run it {run} "
            f"--enable-expert-parallel (LLM(enable_expert_parallel={compiled})), or recompile it: graphinfer "
            f"compile {manifest['model']['path']} -o {art} --tensor-parallel-size {tp}"
            + (" --enable-expert-parallel" if ep else ""))
