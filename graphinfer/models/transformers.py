"""Any Hugging Face decoder through its own transformers modeling code (vLLM's Transformers backend,
model_impl="transformers").

The model is transformers' own `*ForCausalLM`, loaded by transformers (`from_pretrained`: sharded safetensors, tied
embeddings, its weight conversions such as stacked MoE experts), straight onto the engine's device and dtype. Its
attention layers call, through transformers' attention-interface registry, `graphinfer_attention`, which writes the
step's K/V into the layer's paged cache and runs `graphinfer::paged_attention` with what the layer declares (scale,
sliding window, logit soft-capping, sinks; GQA by the head counts). The step's metadata reaches it as a forward
keyword (transformers passes its forward's **kwargs down to attention), so the whole forward is one function of
(input_ids, positions, md), which the compiler captures as an fx graph (compiler/transformers_capture.py) and the
canonicalisation passes bring to graphinfer's ops.

The flat batch of T tokens runs as transformers' batch of one sequence of T tokens, with positions given and no
attention mask (paged attention needs none: causality, chunks and windows come from the metadata).

Tensor parallel (models/transformers_tp.py): the config's base_model_tp_plan with graphinfer's parallel layers; a rank
then builds the module tree with its parameters on meta, splits it, and reads its slices from the safetensors by
parameter name (transformers' loader reads whole tensors).
"""
import contextlib
import glob
import os

import torch
from torch import Tensor, nn

from graphinfer import ops
from graphinfer.distributed import parallel_state as ps
from graphinfer.errors import InvalidConfigError, UnsupportedArchitectureError
from graphinfer.models.layers import AttentionMetadata, PagedAttention, init_buffers
from graphinfer.models.parallel_layers import ColumnParallelLinear, local_heads, local_kv_heads

ATTN_IMPLEMENTATION = "graphinfer"
_MD_KEYWORD = "graphinfer_md"  # the forward keyword that carries the step's AttentionMetadata to the attention layers

# config.model_type -> why it cannot run here (state-space / linear-attention layers keep no paged KV)
_STATE_SPACE = ("mamba", "mamba2", "falcon_mamba", "jamba", "bamba", "zamba", "zamba2", "falcon_h1", "granitemoehybrid",
                "nemotron_h", "lfm2", "lfm2_moe", "qwen3_next", "plamo2", "minimax", "recurrent_gemma", "rwkv", "xlstm")


def unsupported_reason(config) -> str | None:
    """Why transformers' modeling code of this config cannot run on graphinfer, or None."""
    if getattr(config, "is_encoder_decoder", False):
        return f"{config.model_type} is an encoder-decoder model; graphinfer runs decoder-only models"
    layer_types = set(getattr(config, "layer_types", None) or ())
    if config.model_type in _STATE_SPACE or layer_types & {"mamba", "linear_attention", "recurrent", "mamba2"}:
        return (f"{config.model_type} has Mamba / state-space layers (or linear-attention ones), whose state is not a "
                f"paged KV cache")
    return None


def causal_lm_class(config) -> type[nn.Module]:
    """transformers' *ForCausalLM class for the config, or UnsupportedArchitectureError naming why there is none."""
    from transformers import AutoModelForCausalLM

    if (reason := unsupported_reason(config)) is not None:
        raise UnsupportedArchitectureError(f"{config.architectures}: {reason}.")
    mapping = AutoModelForCausalLM._model_mapping
    if type(config) not in mapping:
        if getattr(config, "auto_map", None):
            raise UnsupportedArchitectureError(
                f"{config.architectures} is defined by the checkpoint's own code (auto_map), which graphinfer does not "
                f"run (trust_remote_code); use a model whose code is in transformers.")
        raise UnsupportedArchitectureError(f"{config.architectures} ({config.model_type}) is not a causal LM that "
                                           f"transformers {_transformers_version()} knows.")
    return mapping[type(config)]


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def graphinfer_attention(module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask,
                         scaling: float | None = None, dropout: float = 0.0, sliding_window: int | None = None,
                         softcap: float | None = None, s_aux: Tensor | None = None, **kwargs):
    """transformers' attention-interface signature: query [1, Hq, T, D], key / value [1, Hkv, T, D] -> ([1, T, Hq, D],
    None). The layer's PagedAttention (installed by TransformersForCausalLM) holds its cache and what it declares."""
    md: AttentionMetadata = kwargs[_MD_KEYWORD]
    attn: PagedAttention = module.graphinfer_attn
    # [T, heads, D]: transposed back from transformers' [1, heads, T, D], which canon_transpose cancels in the graph
    q, k, v = (t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (query, key, value))
    ops.reshape_and_cache(k, v, attn.k_cache, attn.v_cache, md.slot_mapping)
    # only what the layer declares becomes an argument: the op's defaults mean none
    extra = {"sliding_window": sliding_window} if sliding_window else {}
    if softcap:
        extra["softcap"] = softcap
    if s_aux is not None:
        extra["sinks"] = s_aux
    o = ops.paged_attention(q, attn.k_cache, attn.v_cache, md.block_tables, md.query_start_loc, md.seq_lens,
                            attn.scale if scaling is None else scaling, **extra)
    return o.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    return None  # paged attention takes causality, chunks and windows from the step's metadata


def register_attention() -> None:
    """Register graphinfer's attention (and its mask, none) under ATTN_IMPLEMENTATION in transformers' registries."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, graphinfer_attention)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


def _is_attention(module: nn.Module) -> bool:
    """A transformers attention layer that calls the attention interface (it has the projections and a layer_idx)."""
    return hasattr(module, "layer_idx") and hasattr(module, "head_dim") and (
        hasattr(module, "o_proj") or hasattr(module, "dense"))


class TransformersForCausalLM(nn.Module):
    """graphinfer's model interface (forward(input_ids, positions, md) -> hidden [T, H], compute_logits) over
    transformers' *ForCausalLM. Its module tree is transformers' (`model.layers.0.self_attn.q_proj`, `lm_head`), so the
    checkpoint's names, the passes and the artifacts see the same paths."""

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.config = hf_model.config
        self.model, self.lm_head = hf_model.model, hf_model.get_output_embeddings()
        c = self.config
        self.logit_scale = getattr(c, "logit_scale", None)  # Cohere: logits * logit_scale
        self.logits_scaling = getattr(c, "logits_scaling", None)  # Granite: logits / logits_scaling
        self.final_logit_softcapping = getattr(c, "final_logit_softcapping", None)  # Gemma 2 / 3
        layers = [m for m in self.model.modules() if _is_attention(m)]
        if not layers:
            raise UnsupportedArchitectureError(f"{c.architectures}: no attention layer of transformers' attention "
                                               f"interface found; graphinfer cannot run its attention.")
        heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or heads
        for m in layers:  # this rank's heads (transformers' code reshapes with -1: its q/k/v carry just these); all of
            # them where the projections' outputs are whole (Phi-3's qkv_proj, "colwise_gather_output")
            split = any(type(c) is ColumnParallelLinear for c in m.modules())
            attn = PagedAttention(local_heads(heads) if split else heads,
                                  local_kv_heads(kv_heads) if split else kv_heads, m.head_dim)
            attn.scale = getattr(m, "scaling", attn.scale)
            m.graphinfer_attn = attn

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype, device: torch.device | str) -> "TransformersForCausalLM":
        """The checkpoint on `device` in `dtype`, with graphinfer's attention: through transformers' own loader (its
        weight conversions, such as per-expert tensors stacked) at tp 1; at tp > 1 this rank's shard, its slices read
        by parameter name."""
        from transformers import AutoConfig

        register_attention()
        config = AutoConfig.from_pretrained(path)
        if ps.tp_size() == 1:
            model = causal_lm_class(config).from_pretrained(path, dtype=dtype, device_map={"": str(device)},
                                                            attn_implementation=ATTN_IMPLEMENTATION)
            return cls(model.eval())
        from graphinfer.models.loader import _safetensors_weights, load_weights

        model = cls.skeleton(config, dtype, device)
        _check_names_match(path, model)
        _materialize(model, device)
        model.tie_weights()
        load_weights(model, _safetensors_weights(path), tied=model.tied)
        return model

    @classmethod
    def skeleton(cls, config, dtype: torch.dtype, device: torch.device | str) -> "TransformersForCausalLM":
        """The module tree (this rank's shard at tp > 1) with its parameters on meta (an artifact's or a checkpoint's
        tensors then take their place) and the non-persistent buffers transformers computes at construction (rotary
        frequencies, embedding scales) on `device`."""
        from transformers.initialization import no_init_weights

        from graphinfer.models.transformers_tp import tensor_parallel

        register_attention()
        with _parameters_on_meta(), torch.device(device), no_init_weights():
            hf = causal_lm_class(config)._from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        if ps.tp_size() > 1:
            tensor_parallel(hf)
            init_buffers(hf, device)
        return cls(hf.eval())

    @property
    def tied(self) -> bool:
        return bool(getattr(self.config.get_text_config(), "tie_word_embeddings", False))

    def forward(self, input_ids: Tensor, positions: Tensor, md: AttentionMetadata) -> Tensor:
        """input_ids, positions [T] -> the final hidden states [T, hidden], as transformers' one sequence of T tokens."""
        out = self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                         **{_MD_KEYWORD: md})
        return out.last_hidden_state[0]

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        """The LM head and what the family's *ForCausalLM does after it (a scale, a divisor, soft-capping)."""
        logits = self.lm_head(hidden_states)
        if self.logit_scale is not None:
            logits = logits * self.logit_scale
        if self.logits_scaling is not None:
            logits = logits / self.logits_scaling
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def tie_weights(self) -> None:
        """Share the input embedding with the LM head where the config ties them (again after an artifact's weights
        were assigned to the embedding)."""
        if self.tied:
            self.lm_head.weight = self.model.get_input_embeddings().weight


@contextlib.contextmanager
def _parameters_on_meta():
    """Modules built here get their parameters on meta (no memory) and their buffers where torch.device says
    (accelerate's init_empty_weights): what transformers computes at construction is kept, no weight is allocated."""
    register = nn.Module.register_parameter

    def on_meta(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def _materialize(model: nn.Module, device) -> None:
    """Every parameter still on meta gets uninitialised memory on `device` (shared ones stay shared)."""
    new: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                if id(p) not in new:
                    new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device), requires_grad=False)
                module._parameters[name] = new[id(p)]


def _check_names_match(path: str, model: TransformersForCausalLM) -> None:
    """At tp > 1 the checkpoint's tensors are read by the model's parameter names; one saved in another layout
    (transformers converts it at load: per-expert MoE tensors stacked, renamed modules) is refused, naming some."""
    from safetensors import safe_open

    names = set(dict(model.named_parameters(remove_duplicate=False)))
    stray = []
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            stray += [k for k in f.keys() if k not in names and not k.endswith("rotary_emb.inv_freq")]
    if stray:
        raise InvalidConfigError(
            f"{path!r} saves {len(stray)} tensors under names the model's parameters do not have (e.g. "
            f"{sorted(stray)[:3]}): transformers converts them at load (e.g. one tensor per MoE expert stacked into "
            f"one), which graphinfer's tensor-parallel loader does not do. Run it at tensor_parallel_size=1 "
            f"(data parallel scales it out).")
