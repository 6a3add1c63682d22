"""Named model shapes with random weights: quick experiments for pass developers and benchmarks without
a checkpoint (nothing can be downloaded here). `LLM("tiny-qwen3")` works like a path, minus the tokenizer."""
import torch

_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True)


def _config(name: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

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
    }
    config = presets[name]()
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return config


# No qwen3-30b-a3b: presets materialise fp32 random weights on the host (120 GB for 30B parameters).
PRESET_NAMES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-qwen3-moe", "smollm2-135m", "qwen3-0.6b")


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
