"""The op vocabulary: `graphinfer::*` custom ops, each with a PyTorch reference and a fake (meta) impl.

Importing this package registers them; models call them through torch.ops.graphinfer.* or these names.
Backend implementations live in subpackages a platform imports: cpu/ (C++ kernels), npu/ (torch_npu), triton/.
"""
from graphinfer.ops.activation import gelu_and_mul, silu_and_mul
from graphinfer.ops.attention import paged_attention, reshape_and_cache
from graphinfer.ops.bitmask import apply_token_bitmask
from graphinfer.ops.lora import lora_expand, lora_shrink
from graphinfer.ops.mla import concat_and_cache_mla, mla_attention, mla_attention_auto, mla_latent_attention
from graphinfer.ops.moe import (eplb_map_to_physical_and_record, fused_experts, fused_moe, moe_combine, moe_count_experts,
                                moe_dispatch, moe_grouped_mlp)
from graphinfer.ops.norm import add_rms_norm, rms_norm
from graphinfer.ops.quant import (add_rms_norm_quant, block_fp8_linear, dynamic_quant, rms_norm_quant, scaled_mm,
                                  silu_and_mul_quant, wo_linear)
from graphinfer.ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_cache
from graphinfer.ops.rejection import rejection_sample
from graphinfer.ops.rotary import rotary_embedding

__all__ = ["add_rms_norm", "apply_token_bitmask", "add_rms_norm_quant", "block_fp8_linear", "dynamic_quant",
           "rms_norm_quant", "scaled_mm", "silu_and_mul_quant", "wo_linear", "concat_and_cache_mla", "mla_attention",
           "mla_attention_auto", "mla_latent_attention", "eplb_map_to_physical_and_record", "fused_experts", "fused_moe",
           "gelu_and_mul", "lora_expand", "lora_shrink", "moe_combine", "moe_count_experts", "moe_dispatch",
           "moe_grouped_mlp", "paged_attention",
           "qk_norm_rope", "qk_norm_rope_cache", "rejection_sample", "reshape_and_cache", "rms_norm", "rotary_embedding", "silu_and_mul"]
