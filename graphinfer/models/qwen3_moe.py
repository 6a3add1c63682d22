"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B), written plainly like HF's modeling_qwen3_moe.

Attention and the decoder layer are llama.py's Qwen3 ones. The sparse MoE block is the naive chain:
router Linear -> softmax (fp32) -> top-k -> optional renormalisation -> the experts (parallel_layers.MoEExperts:
moe_dispatch -> moe_grouped_mlp -> moe_combine, each expert's intermediate dimension split over the TP ranks).
The fuse_moe pass turns that chain into one graphinfer::fused_moe.
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphinfer.errors import UnsupportedArchitectureError
from graphinfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, Qwen3Attention
from graphinfer.models.parallel_layers import MoEExperts


class Qwen3MoeSparseMoeBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(config.hidden_size, config.num_experts, bias=False)  # the router
        self.experts = MoEExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)

    def forward(self, hidden_states: Tensor) -> Tensor:
        router_logits = self.gate(hidden_states)  # [T, E]
        routing_weights = F.softmax(router_logits, dim=-1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        if self.norm_topk_prob:
            routing_weights = routing_weights / routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(router_logits.dtype)
        return self.experts(hidden_states, selected_experts, routing_weights)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, config):
        if config.hidden_act != "silu" or getattr(config, "sliding_window", None) is not None:
            raise UnsupportedArchitectureError(
                f"Qwen3-MoE with hidden_act={config.hidden_act!r} / sliding_window={config.sliding_window} is not "
                f"supported; graphinfer runs SwiGLU experts and full attention (use_sliding_window=false).")
        super().__init__(config)

    @staticmethod
    def make_layer(config, index: int) -> nn.Module:
        sparse = (index not in config.mlp_only_layers and config.num_experts > 0
                  and (index + 1) % config.decoder_sparse_step == 0)
        mlp = Qwen3MoeSparseMoeBlock(config) if sparse else LlamaMLP(config)
        return LlamaDecoderLayer(config, Qwen3Attention(config, config.attention_bias), mlp)
