"""Named model shapes with random weights: quick experiments for pass developers and benchmarks without
a checkpoint (nothing can be downloaded here). `LLM("tiny-qwen3")` works like a path, minus the tokenizer."""
import torch

_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


def _config(name: str):
    from transformers import DeepseekV3Config, LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    presets = {
        "tiny-llama": lambda: LlamaConfig(**_TINY),
        "tiny-qwen2": lambda: Qwen2Config(**_TINY),
        "tiny-qwen3": lambda: Qwen3Config(**_TINY, head_dim=32),
        "tiny-qwen3-moe": lambda: Qwen3MoeConfig(**_TINY, head_dim=32, moe_intermediate_size=32, num_experts=8,
                                                 num_experts_per_tok=2, norm_topk_prob=True),
        # Real shapes (random weights): timing does not depend on the values.
        "smollm2-135m": lambda: LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0}),
        "qwen3-0.6b": lambda: Qwen3Config(
            vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
            num_key_value_heads=8, head_dim=128, max_position_embeddings=40960, rms_norm_eps=1e-6,
            tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
        "tiny-deepseek-v3": lambda: DeepseekV3Config(
            **{**_TINY, "tie_word_embeddings": False, "num_key_value_heads": 4}, moe_intermediate_size=32, q_lora_rank=32,
            kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
            num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1, first_k_dense_replace=1,
            routed_scaling_factor=2.5, norm_topk_prob=True, num_nextn_predict_layers=0),
        # DeepSeek-V3's attention and routing (MLA 16 heads, q / kv LoRA 1536 / 512, nope 128 + rope 64, v 128;
        # sigmoid grouped top-k with a correction bias, a shared expert pair, YaRN), reduced to 4 layers of hidden 2048
        # with 64 experts of 512 (the MLA cache: 576 numbers per token per layer).
        "deepseek-v3-4l": lambda: DeepseekV3Config(
            vocab_size=32000, hidden_size=2048, intermediate_size=4096, moe_intermediate_size=512, num_hidden_layers=4,
            num_attention_heads=16, num_key_value_heads=16, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
            qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4,
            n_shared_experts=2, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True,
            max_position_embeddings=16384, num_nextn_predict_layers=0, tie_word_embeddings=False,
            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                             "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096, "beta_fast": 32,
                             "beta_slow": 1}),
    }
    config = presets[name]()
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


# No qwen3-30b-a3b: presets materialise fp32 random weights on the host (120 GB for 30B parameters).
PRESET_NAMES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "smollm2-135m", "qwen3-0.6b",
                "tiny-deepseek-v3", "deepseek-v3-4l")


def preset_config(name: str):
    """The HF config of a named preset, or None if `name` is not one."""
    return _config(name) if name in PRESET_NAMES else None


# Part of a preset's fingerprint: artifacts compiled from a preset's earlier random weights are refused.
INIT_VERSION = 2


@torch.no_grad()
def init_random_weights(model: torch.nn.Module, seed: int) -> None:
    """Deterministic random weights that keep a tiny model's computation informative:

    - matrices N(0, (2 / sqrt(fan_in))^2), so each layer changes the residual stream as much as the embedding
      (with N(0, 0.02) weights and a tied LM head every model just repeats its last input token, and a
      rewrite that breaks attention still gives the same greedy tokens); q/k projections N(0, 1 / fan_in),
      so attention scores stay moderate (larger ones make a deep model's outputs swing with rounding noise);
      embeddings N(0, 1);
    - norm gains U(0.5, 1.5), not ones, so a rewrite that swaps or drops a norm weight changes the outputs;
    - biases (and other vectors) N(0, 0.02)."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.copy_(0.5 + torch.rand(p.shape, generator=g))
        elif "embed" in name:
            p.copy_(torch.randn(p.shape, generator=g))
        elif p.dim() >= 2:
            scale = 1.0 if name.endswith(("q_proj.weight", "k_proj.weight")) else 2.0
            p.copy_(torch.randn(p.shape, generator=g) * (scale / p.shape[-1] ** 0.5))
        else:
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
