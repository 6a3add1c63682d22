"""DeepSeek-V2 / V3 (and Kimi-K2, which declares DeepseekV3ForCausalLM), written plainly like HF's
modeling_deepseek_v3: multi-head latent attention (MLA) and DeepSeekMoE.

Attention keeps HF's expanded form: q (through the q LoRA when q_lora_rank is set), the latent c_kv (normalised) and
the shared k_pe from kv_a_proj_with_mqa, rotary on q's and k's rope parts (interleaved pairs as DeepSeek ships them:
GPT-J style, equal in every score to HF's de-interleaving variant), then MLAAttention: the latent row goes to the paged
latent cache and mla_attention expands the context through kv_b_proj's weight. The absorb_mla pass rewrites that to
the absorbed form (multi-query attention over the latent). The softmax scale is qk_head_dim^-0.5, times mscale^2 under
YaRN (DeepSeek's mscale_all_dim), as HF's yarn_apply_mscale.

MoE layers (from first_k_dense_replace, every moe_layer_freq-th): the router in fp32, V3's sigmoid scores with
e_score_correction_bias for the choice only and grouped top-k (groups ranked by the sum of their two best biased
scores, topk_group kept), V2's softmax (greedy or group-limited greedy); weights renormalised (V3 with norm_topk_prob)
and times routed_scaling_factor; the routed experts (parallel_layers.MoEExperts) plus the shared experts' MLP.
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphinfer.errors import UnsupportedArchitectureError
from graphinfer.models.layers import AttentionMetadata, MLAAttention, RMSNorm, RotaryEmbedding, rope_parameters
from graphinfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from graphinfer.models.parallel_layers import (ColumnParallelLinear, MoEExperts, RowParallelLinear, local_heads,
                                               num_experts)


def softmax_scale(config) -> float:
    """qk_head_dim^-0.5, times mscale^2 under YaRN with mscale_all_dim (HF's yarn_apply_mscale)."""
    import math

    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = rope_parameters(config)
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        factor = rope["factor"]
        mscale = 0.1 * rope["mscale_all_dim"] * math.log(factor) + 1.0 if factor > 1 else 1.0
        scale *= mscale * mscale
    return scale


class DeepseekV2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = local_heads(config.num_attention_heads)
        self.q_lora_rank, self.kv_lora_rank = config.q_lora_rank, config.kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim = config.qk_nope_head_dim, config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        qk_head_dim, heads, bias = self.qk_nope_head_dim + self.qk_rope_head_dim, config.num_attention_heads, \
            getattr(config, "attention_bias", False)
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(config.hidden_size, heads * qk_head_dim, bias=False)
        else:  # the q LoRA's down projection and norm are whole on every rank, its up projection split by heads
            self.q_a_proj = nn.Linear(config.hidden_size, self.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, heads * qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.qk_nope_head_dim + self.v_head_dim),
                                              bias=False)
        self.kv_b_proj.quantizable = False  # mla_attention reads its weight (absorb_mla splits it): model dtype
        self.o_proj = RowParallelLinear(heads * self.v_head_dim, config.hidden_size, bias=bias)
        interleaved = getattr(config, "rope_interleave", True)  # V2's complex-number rotary is interleaved too
        self.rotary_emb = RotaryEmbedding(config, self.qk_rope_head_dim, config.max_position_embeddings,
                                          is_neox=not interleaved)
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                                 self.v_head_dim, softmax_scale(config))

    def forward(self, positions: Tensor, hidden_states: Tensor, md: AttentionMetadata) -> Tensor:
        T = hidden_states.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(T, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c = self.kv_a_layernorm(kv_c)
        q_pe, k_pe = self.rotary_emb(positions, q_pe.contiguous(), k_pe.contiguous())
        q = torch.cat((q_nope, q_pe.view(T, self.num_heads, self.qk_rope_head_dim)), dim=-1)
        return self.o_proj(self.attn(q, kv_c, k_pe, self.kv_b_proj.weight, md))


class DeepseekV2MoE(nn.Module):
    def __init__(self, config, v3: bool):
        super().__init__()
        self.top_k, self.num_experts = config.num_experts_per_tok, num_experts(config)
        self.routed_scaling_factor = config.routed_scaling_factor
        self.n_group, self.topk_group = getattr(config, "n_group", None) or 1, getattr(config, "topk_group", None) or 1
        self.sigmoid = v3  # V3 scores by sigmoid (noaux_tc), V2 by softmax
        self.topk_method = "noaux_tc" if v3 else (getattr(config, "topk_method", None) or "greedy")
        self.norm_topk_prob = v3 and getattr(config, "norm_topk_prob", False)  # HF's V2 never renormalises
        self.gate = DeepseekRouter(config.hidden_size, self.num_experts, with_bias=self.sigmoid)
        self.experts = MoEExperts(self.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = LlamaMLP(config, intermediate_size=config.moe_intermediate_size *
                                       config.n_shared_experts) if config.n_shared_experts else None

    def _route(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
        logits = F.linear(hidden_states.float(), self.gate.weight.float())  # [T, E] in fp32, as HF
        E, G = self.num_experts, self.n_group
        if self.sigmoid:
            scores = logits.sigmoid()
            choice = scores + self.gate.e_score_correction_bias.float()
            group_scores = choice.view(-1, G, E // G).topk(2, dim=-1)[0].sum(dim=-1)
        else:
            scores = choice = logits.softmax(dim=-1)
            group_scores = choice.view(-1, G, E // G).max(dim=-1).values
        if self.topk_method in ("noaux_tc", "group_limited_greedy") and G > 1:
            group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
            group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
            keep = group_mask.unsqueeze(-1).expand(-1, G, E // G).reshape(-1, E).bool()
            choice = choice.masked_fill(~keep, float("-inf") if self.sigmoid else 0.0)
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.routed_scaling_factor

    def forward(self, hidden_states: Tensor) -> Tensor:
        ids, weights = self._route(hidden_states)
        out = self.experts(hidden_states, ids, weights.to(hidden_states.dtype))
        if self.shared_experts is not None:
            out = out + self.shared_experts(hidden_states)
        return out


class DeepseekRouter(nn.Module):
    """The router's weight [E, H] (HF's `mlp.gate.weight`) and V3's e_score_correction_bias [E] (fp32)."""

    def __init__(self, hidden_size: int, num_experts: int, with_bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))
        if with_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts, dtype=torch.float32),
                                                        requires_grad=False)


class DeepseekV2ForCausalLM(LlamaForCausalLM):
    v3 = False

    def __init__(self, config):
        if config.hidden_act != "silu":
            raise UnsupportedArchitectureError(f"DeepSeek with hidden_act={config.hidden_act!r}: graphinfer runs "
                                               f"SwiGLU (silu) experts.")
        super().__init__(config)

    def make_layer(self, config, index: int) -> nn.Module:
        moe = (num_experts(config) and index >= config.first_k_dense_replace
               and index % (getattr(config, "moe_layer_freq", 1) or 1) == 0)
        mlp = DeepseekV2MoE(config, self.v3) if moe else LlamaMLP(config)
        return LlamaDecoderLayer(config, DeepseekV2Attention(config), mlp)

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """The checkpoint's MTP layers (model.layers.<num_hidden_layers>...), which the target model does not hold
        (speculative method "mtp" loads the first beside it: models/deepseek_mtp.py)."""
        parts = name.split(".")
        return len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and \
            int(parts[2]) >= self.config.num_hidden_layers


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    v3 = True
