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
"""
import torch
from torch import Tensor, nn

from graphinfer import ops
from graphinfer.errors import UnsupportedArchitectureError
from graphinfer.models.layers import AttentionMetadata, PagedAttention

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
        for m in layers:
            heads = c.num_attention_heads
            kv_heads = getattr(c, "num_key_value_heads", None) or heads
            attn = PagedAttention(heads, kv_heads, m.head_dim)
            attn.scale = getattr(m, "scaling", attn.scale)
            m.graphinfer_attn = attn

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype, device: torch.device | str) -> "TransformersForCausalLM":
        """The checkpoint through transformers' own loader, on `device` in `dtype`, with graphinfer's attention."""
        from transformers import AutoConfig

        register_attention()
        config = AutoConfig.from_pretrained(path)
        model = causal_lm_class(config).from_pretrained(path, dtype=dtype, device_map={"": str(device)},
                                                        attn_implementation=ATTN_IMPLEMENTATION)
        return cls(model.eval())

    @classmethod
    def skeleton(cls, config, dtype: torch.dtype, device: torch.device | str) -> "TransformersForCausalLM":
        """The module tree on `device` with uninitialised weights (an artifact's then replace them) and the
        non-persistent buffers transformers computes at construction (rotary frequencies, embedding scales)."""
        from transformers.initialization import no_init_weights

        register_attention()
        with torch.device(device), no_init_weights():
            model = causal_lm_class(config)._from_config(config, dtype=dtype, attn_implementation=ATTN_IMPLEMENTATION)
        return cls(model.eval())

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
        if getattr(self.config.get_text_config(), "tie_word_embeddings", False):
            self.lm_head.weight = self.model.get_input_embeddings().weight
