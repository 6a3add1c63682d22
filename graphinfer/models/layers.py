"""Layers shared by the model families: thin modules over the graphinfer:: ops, plus the attention metadata."""
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor, nn

from graphinfer import ops
from graphinfer.errors import UnsupportedArchitectureError


@dataclass
class AttentionMetadata:
    """Where the flat batch's tokens live in the paged cache (see graphinfer/ops/attention.py)."""
    slot_mapping: Tensor     # [T] int64, -1 = write nothing
    block_tables: Tensor     # [B, max_blocks] int32
    query_start_loc: Tensor  # [B + 1] int32
    seq_lens: Tensor         # [B] int32, context length including this step's tokens


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


def rope_parameters(config) -> dict:
    """The config's RoPE parameters; "rope_type" other than "default" needs transformers' init functions."""
    return getattr(config, "rope_parameters", None) or {"rope_type": "default", "rope_theta": config.rope_theta}


class RotaryEmbedding(nn.Module):
    """Holds the [max_position, rot_dim] cos/sin cache; computed in fp32 exactly as HF does, then cast."""

    def __init__(self, config, head_dim: int, max_position: int, is_neox: bool = True):
        super().__init__()
        self.config, self.head_dim, self.max_position = config, head_dim, max_position
        self.is_neox = is_neox  # False: interleaved pairs (GPT-J; DeepSeek)
        # Built on the meta device (build_model), the cache is only a placeholder until reset_cache().
        on_meta = torch.empty(0).is_meta
        cache = torch.empty(max_position, head_dim) if on_meta else self._compute_cache()
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _compute_cache(self) -> Tensor:
        rope = rope_parameters(self.config)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        with torch.device("cpu"):
            if rope_type == "default":
                exponent = torch.arange(0, self.head_dim, 2, dtype=torch.int64).to(torch.float) / self.head_dim
                inv_freq, scaling = 1.0 / (rope["rope_theta"] ** exponent), 1.0
            else:  # llama3, linear, yarn, ...: HF's own init functions keep us bit-identical to the reference
                from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

                config = self.config
                if not hasattr(config, "standardize_rope_params"):  # an artifact's plain config: HF's functions need theirs
                    from transformers import AutoConfig

                    config = AutoConfig.for_model(**config.to_dict())

                if rope_type == "dynamic" or rope_type not in ROPE_INIT_FUNCTIONS:
                    raise UnsupportedArchitectureError(
                        f"rope_type {rope_type!r} is not supported (position-dependent scaling); "
                        f"supported: default and {sorted(set(ROPE_INIT_FUNCTIONS) - {'dynamic'})}.")
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
            freqs = torch.outer(torch.arange(self.max_position, dtype=torch.float), inv_freq.float())
            return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), dim=-1)

    def reset_cache(self, device: torch.device | str):
        """Compute the cache on `device` after meta-device construction (see init_buffers)."""
        self.cos_sin_cache = self._compute_cache().to(device)

    def forward(self, positions: Tensor, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return ops.rotary_embedding(positions, q, k, self.head_dim, self.cos_sin_cache, self.is_neox)


class PagedAttention(nn.Module):
    """Writes this step's K/V into the layer's paged cache, then attends over the cached context.

    The model runner sets the k_cache / v_cache buffers once it has sized the KV pool; buffers (not plain
    attributes) so a traced graph refers to each layer's cache by its path.
    Optional, as Hugging Face attention layers declare them (graphinfer/ops/attention.py): sliding_window (positions),
    softcap (logit soft-capping), sinks (a [num_heads] parameter of per-head sink logits, gpt-oss). Each reaches the
    op only when set, so a layer without them traces to the same 7-argument call as before.
    """

    cache_planes = 2  # K and V; MLA's latent cache is one plane read as both

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, sliding_window: int | None = None,
                 softcap: float | None = None, sinks: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim ** -0.5
        self.sliding_window, self.softcap = sliding_window, softcap
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self.register_buffer("k_cache", torch.empty(0), persistent=False)
        self.register_buffer("v_cache", torch.empty(0), persistent=False)

    def _options(self) -> dict:
        """The op's optional arguments this layer sets."""
        options = {}
        if self.sliding_window:
            options["sliding_window"] = self.sliding_window
        if self.softcap:
            options["softcap"] = self.softcap
        if self.sinks is not None:
            options["sinks"] = self.sinks
        return options

    def forward(self, q: Tensor, k: Tensor, v: Tensor, md: AttentionMetadata) -> Tensor:
        T = q.shape[0]
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        ops.reshape_and_cache(k, v, self.k_cache, self.v_cache, md.slot_mapping)
        o = ops.paged_attention(q, self.k_cache, self.v_cache, md.block_tables, md.query_start_loc, md.seq_lens,
                                self.scale, **self._options())
        return o.view(T, self.num_heads * self.head_dim)


class MLAAttention(PagedAttention):
    """Multi-head latent attention over a paged latent cache (graphinfer/ops/mla.py): one cache plane of rows
    [c_kv (kv_lora_rank), k_pe (qk_rope_head_dim)], read as a one-KV-head cache of head_dim L + R (k_cache and v_cache
    are the same view). The model's form is the expanded one (mla_attention reads kv_b_proj's weight); the
    absorb_mla pass rewrites it to the absorbed one."""
    cache_planes = 1

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float):
        super().__init__(num_heads, 1, kv_lora_rank + qk_rope_head_dim)
        self.kv_lora_rank, self.qk_nope_head_dim, self.v_head_dim = kv_lora_rank, qk_nope_head_dim, v_head_dim
        self.scale = scale

    def forward(self, q: Tensor, kv_c: Tensor, k_pe: Tensor, kv_b_weight: Tensor, md: AttentionMetadata) -> Tensor:
        """q [T, H, N + R] (k_pe and q's rope part rotated), kv_c [T, L] (normalised), k_pe [T, R] -> [T, H * V]."""
        ops.concat_and_cache_mla(kv_c, k_pe, self.k_cache, md.slot_mapping)
        o = ops.mla_attention(q, self.k_cache, kv_b_weight, md.block_tables, md.query_start_loc, md.seq_lens,
                              self.scale, self.qk_nope_head_dim, self.v_head_dim)
        return o.reshape(q.shape[0], -1)


def init_buffers(model: nn.Module, device: torch.device | str) -> None:
    """Compute the non-persistent buffers of a model built on the meta device: the cos/sin caches once per shape
    (every layer shares it), and those of modules with reset_buffers (a vocab-parallel embedding's offset)."""
    caches: dict[tuple, Tensor] = {}
    for m in model.modules():
        if hasattr(m, "reset_buffers"):
            m.reset_buffers(device)
        if isinstance(m, RotaryEmbedding):
            key = (m.head_dim, m.max_position)
            if key not in caches:
                m.reset_cache(device)
                caches[key] = m.cos_sin_cache
            m.cos_sin_cache = caches[key]


def activation_dtype(model: nn.Module) -> torch.dtype:
    """The dtype the model computes in (its final norm's; a quantized LM head's weight holds codes)."""
    return model.model.norm.weight.dtype


def allocate_kv_cache(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype | None = None) -> Tensor:
    """One tensor [layers, planes, num_blocks, block_size, kv_heads, head_dim] (planes: K and V, or MLA's one latent
    plane, which a layer reads as both); each attention layer gets its views. dtype: the model's activation_dtype
    unless given (a draft module without a final norm)."""
    layers = [m for m in model.modules() if isinstance(m, PagedAttention)]
    if dtype is None:
        dtype, device = activation_dtype(model), model.model.norm.weight.device
    else:
        device = next(model.parameters()).device
    planes = layers[0].cache_planes
    shape = (len(layers), planes, num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    if device.type == "cpu":  # calloc'd (numpy): the OS maps zero pages as they are first written, so allocating costs
        # nothing (torch.zeros writes every byte); the cpu platform commits them in a thread (populate_in_background)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        kv = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
    else:
        kv = torch.zeros(shape, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv[i, 0], kv[i, planes - 1]
    return kv
