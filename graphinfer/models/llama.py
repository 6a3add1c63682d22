"""Llama-family decoder models (Llama 2/3.x, SmolLM2, Qwen2, Qwen3), written plainly like HF's modeling_llama.

Deliberately naive: separate q/k/v and gate/up projections, a plain residual add before each RMSNorm.
Fusion is the compiler passes' job. Input is a flat batch of T tokens across requests (no batch dim).
Tensor parallel through the layers of parallel_layers.py (as vLLM's models): each rank holds its heads and
its part of the MLP; at tp 1 they are the plain nn.Linear / nn.Embedding.
"""
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphinfer.distributed import parallel_state as ps
from graphinfer.models.layers import AttentionMetadata, PagedAttention, RMSNorm, RotaryEmbedding
from graphinfer.models.parallel_layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                               VocabParallelEmbedding, local_heads, local_kv_heads)


class LlamaAttention(nn.Module):
    qk_norm = False  # Qwen3 normalises q and k per head before rotary

    def __init__(self, config, bias: bool):
        super().__init__()
        total_heads, total_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.num_heads, self.num_kv_heads = local_heads(total_heads), local_kv_heads(total_kv_heads)  # this rank's
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // total_heads
        kv_shards = min(ps.tp_size(), total_kv_heads)  # fewer KV heads than ranks: replicated
        self.q_proj = ColumnParallelLinear(config.hidden_size, total_heads * self.head_dim, bias=bias)
        self.k_proj = ColumnParallelLinear(config.hidden_size, total_kv_heads * self.head_dim, bias, kv_shards)
        self.v_proj = ColumnParallelLinear(config.hidden_size, total_kv_heads * self.head_dim, bias, kv_shards)
        self.o_proj = RowParallelLinear(total_heads * self.head_dim, config.hidden_size,
                                        bias=getattr(config, "attention_bias", False))
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(config, self.head_dim, config.max_position_embeddings)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

    def forward(self, positions: Tensor, hidden_states: Tensor, md: AttentionMetadata) -> Tensor:
        q = self.q_proj(hidden_states)
        k = self.k_proj(hidden_states)
        v = self.v_proj(hidden_states)
        if self.qk_norm:
            T = hidden_states.shape[0]
            q = self.q_norm(q.view(T, self.num_heads, self.head_dim)).view(T, -1)
            k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim)).view(T, -1)
        q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, md))


class Qwen3Attention(LlamaAttention):
    qk_norm = True


class LlamaMLP(nn.Module):
    def __init__(self, config, bias: bool = False, intermediate_size: int | None = None):
        super().__init__()
        intermediate_size = intermediate_size or config.intermediate_size  # another for MoE shared experts
        self.gate_proj = ColumnParallelLinear(config.hidden_size, intermediate_size, bias=bias)
        self.up_proj = ColumnParallelLinear(config.hidden_size, intermediate_size, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config, attention: nn.Module, mlp: nn.Module):
        super().__init__()
        self.self_attn = attention
        self.mlp = mlp
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: Tensor, hidden_states: Tensor, md: AttentionMetadata) -> Tensor:
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(positions, hidden_states, md)
        hidden_states = residual + hidden_states

        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + hidden_states


class LlamaModel(nn.Module):
    def __init__(self, config, make_layer):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: Tensor, positions: Tensor, md: AttentionMetadata) -> Tensor:
        hidden_states = self.embed_tokens(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states, md)
        return self.norm(hidden_states)


class LlamaForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, self.make_layer)
        self.lm_head = ParallelLMHead(config.hidden_size, config.vocab_size)
        self.tie_weights()

    def tie_weights(self):
        """Share the embedding with the LM head (again after to_empty(), which unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @staticmethod
    def make_layer(config, index: int) -> nn.Module:
        bias = getattr(config, "attention_bias", False)
        return LlamaDecoderLayer(config, LlamaAttention(config, bias), LlamaMLP(config, getattr(config, "mlp_bias", False)))

    def forward(self, input_ids: Tensor, positions: Tensor, md: AttentionMetadata) -> Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden]."""
        return self.model(input_ids, positions, md)

    def compute_logits(self, hidden_states: Tensor) -> Tensor:
        return self.lm_head(hidden_states)


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_layer(config, index: int) -> nn.Module:  # q/k/v always carry a bias in Qwen2
        return LlamaDecoderLayer(config, LlamaAttention(config, True), LlamaMLP(config))


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def make_layer(config, index: int) -> nn.Module:
        return LlamaDecoderLayer(config, Qwen3Attention(config, getattr(config, "attention_bias", False)), LlamaMLP(config))
