"""A zoo of tiny random-weight HF decoders, saved by transformers, for the `model_impl="transformers"` path.

Every entry is built from its transformers config class (no hub access: nothing is downloaded), in fp32, under a fixed
seed, with the parameters that init leaves at a constant (norm gains and biases, linear biases, router and
score-correction biases, attention sinks) perturbed away from it, and saved with `save_pretrained` as safetensors.
HF transformers' own modeling code on the saved weights (fp32, eager attention) is the oracle: `hf_greedy`,
`hf_logits`, `greedy_matches_hf`.

The weights are drawn wider than HF's init (initializer_range 0.1, not 0.02): at 0.02 a 64-wide model's attention
scores are ~0.03, attention is uniform, and a wrong sliding window, softcap, sink or scaling would not change a
token. Sliding windows are 8 or 16 tokens so the prompts of ZOO_PROMPTS (5, 23, 41, 67 tokens) cross them; softcaps
are lowered to where a tiny model's scores reach them. Prompts are token ids: no tokenizer is shipped.

name          HF class (config class)                       what it exercises
----------------------------------------------------------------------------------------------------------------------
gemma3        Gemma3ForCausalLM (Gemma3TextConfig)          (1 + w) RMSNorm x4 per layer, q/k-norm, embeddings *
                                                            sqrt(hidden), query_pre_attn_scalar (24 != head_dim 16),
                                                            sliding (window 8) / full layers with their own rope (10k
                                                            / 1M + linear x8), gelu-tanh GLU, tied
gemma2        Gemma2ForCausalLM (Gemma2Config)              (1 + w) RMSNorm x4 per layer, attention logit softcap
                                                            (2.0) and final logit softcap (1.0), sliding (8) / full
                                                            alternating, query_pre_attn_scalar 24, tied
mistral       MistralForCausalLM (MistralConfig)            sliding window (16) on every layer (Mistral-7B-v0.1
                                                            style), GQA, untied
mixtral       MixtralForCausalLM (MixtralConfig)            MoE: 4 experts, top-2 softmax routing renormalised, rope
                                                            1e6, untied; saved as sharded safetensors
phi3          Phi3ForCausalLM (Phi3Config)                  fused qkv_proj and gate_up_proj in the checkpoint, partial
                                                            rotary 0.75 and longrope (short/long factors, attention
                                                            factor) as Phi-4-mini, tied as Phi-4-mini
phi3_rope     Phi3ForCausalLM (Phi3Config)                  Phi-3-mini-4k / Phi-4 style: fused qkv_proj and gate_up_proj,
                                                            default rope with partial rotary 0.75, untied
olmo2         Olmo2ForCausalLM (Olmo2Config)                norms after attention and MLP (no pre-norm), q/k RMSNorm
                                                            over the whole projected width (heads * head_dim), untied
glm4          Glm4ForCausalLM (Glm4Config)                  partial rotary 0.5 with interleaved (GPT-J) pairs, q/k/v
                                                            bias (no o bias), fused gate_up_proj, extra post-attention
                                                            / post-MLP norms (4 per layer), untied
smollm3       SmolLM3ForCausalLM (SmolLM3Config)            NoPE layers (every 4th layer has no rope), rope theta 2e6,
                                                            tied
ernie4_5      Ernie4_5ForCausalLM (Ernie4_5Config)          interleaved rotary, rope 5e5, tied
ernie4_5_moe  Ernie4_5_MoeForCausalLM (Ernie4_5_MoeConfig)  MoE from layer 1 (layer 0 dense), shared expert,
                                                            e_score_correction_bias in expert choice only,
                                                            renormalised top-k with norm_min, interleaved rotary, tied
gpt_oss       GptOssForCausalLM (GptOssConfig)              attention sinks, sliding (8) / full alternating, q/k/v/o
                                                            biases, yarn rope, MoE with router bias, softmax over the
                                                            top-k, experts stored stacked with interleaved gate/up
                                                            columns and biases, clamped swiglu ((up + 1) * gate *
                                                            sigmoid(1.702 gate)), untied
cohere2       Cohere2ForCausalLM (Cohere2Config)            mean-subtracting LayerNorm (no bias), parallel attention +
                                                            MLP off one norm, interleaved rotary on sliding layers and
                                                            NoPE on full layers, sliding (8) 2:1, logit_scale 0.0625,
                                                            tied
qwen2_moe     Qwen2MoeForCausalLM (Qwen2MoeConfig)          MoE: 4 experts top-2 not renormalised, shared expert with
                                                            a sigmoid gate, q/k/v bias, untied
granitemoe    GraniteMoeForCausalLM (GraniteMoeConfig)      MoE (4 experts top-2, stacked input_linear /
                                                            output_linear), embedding_multiplier 12,
                                                            residual_multiplier 0.22, attention_multiplier 1/head_dim
                                                            (replaces 1/sqrt(head_dim)), logits divided by
                                                            logits_scaling 6, untied
starcoder2    Starcoder2ForCausalLM (Starcoder2Config)      LayerNorm with bias, GELU (tanh) MLP c_fc/c_proj with
                                                            biases, q/k/v/o biases, sliding window 16 on every layer,
                                                            tied
granite       GraniteForCausalLM (GraniteConfig)            dense Granite-3 multipliers (embedding 12, residual 0.22,
                                                            attention 1/head_dim, logits / 8), untied

Tied models get their embeddings scaled by 0.25 after init (ZooSpec.embed_init_scale): tied and at full size, the
token's own embedding wins the LM head's dot product and greedy decoding repeats one token.

Sliding windows are HF's: a query at position i attends keys j with i - window < j <= i (the window counts the
query itself).

Unsupported (for the refusal tests), in UNSUPPORTED: a T5 encoder-decoder (T5ForConditionalGeneration) and a Mamba
(MambaForCausalLM, state-space layers, no attention).

Every architecture of the requested list exists in transformers 5.17 and builds offline; none had to be left out.
Family values that were changed for the tiny models are said in each spec's notes (softcaps, windows, multipliers).

HF quirks met on the way (transformers 5.17):
- generate() fills every field left None in the GenerationConfig it is given from the model's own
  generation_config, so eos_token_id=None does not turn EOS off; min_new_tokens would mask EOS's logit (another
  greedy token wherever EOS is the argmax). hf_greedy clears EOS on the model's generation_config for the call.
- Phi3Config with longrope logs "set the `factor` field ... instead" for original_max_position_embeddings: harmless,
  the Phi-3/4 checkpoints are written that way; HF takes factor = max_position_embeddings / original (4 here). HF
  switches to long_factor when a sequence passes original_max_position_embeddings (256): no zoo prompt does.
- Gemma 3's rope_parameters is a dict per layer type; an override must give both types.
- Starcoder2Config's defaults put bos/eos (50256) outside its own vocab (49152): every zoo config sets ids 1/2/0.
- In fp32 no zoo model has an exact top-2 tie along 16 greedy tokens of ZOO_PROMPTS (smallest relative gap 1.4e-4,
  qwen2_moe); in bf16 such gaps are ties (bf16's ulp is 2**-8 relative), so 16-bit comparisons need a bf16-sized
  tie tolerance, not greedy_matches_hf's default 1e-5.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import warnings
from dataclasses import dataclass, field

import torch

INIT_RANGE = 0.1  # see the docstring: wide enough that attention is not uniform
ZOO_PROMPT_LENGTHS = (5, 23, 41, 67)
ZOO_MIN_VOCAB = 256

# Shared tiny shape: hidden 64, 4 query heads / 2 kv heads of 16, MLP 128, 512 positions, ids in range.
_BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, initializer_range=INIT_RANGE, use_cache=True,
             bos_token_id=1, eos_token_id=2, pad_token_id=0)


@dataclass(frozen=True)
class ZooSpec:
    model_cls: str  # transformers class name (AutoModelForCausalLM picks it from the config; checked in the tests)
    config_cls: str
    kwargs: dict
    notes: str
    moe: bool = False
    sliding_window: int | None = None  # the window of the model's sliding layers, None if it has none
    shard: str | None = None  # max_shard_size for save_pretrained (several safetensors files), None: one file
    exercises: tuple = field(default_factory=tuple)  # short tags: "sliding", "softcap", "sinks", ...
    # Input embeddings scaled after init; None: 0.25 where tied, else 1. With tied embeddings the residual stream's
    # token embedding wins the LM head's dot product, and greedy output repeats one token; smaller embeddings let the
    # layers decide. Granite's multiplier 12 is undone (1/12).
    embed_init_scale: float | None = None

    def config(self):
        import transformers

        return getattr(transformers, self.config_cls)(**{**_BASE, **self.kwargs})


def _rope(theta, **extra):
    return {"rope_type": "default", "rope_theta": theta, **extra}


ZOO: dict[str, ZooSpec] = {
    "gemma3": ZooSpec(
        "Gemma3ForCausalLM", "Gemma3TextConfig",
        dict(num_hidden_layers=3, head_dim=16, vocab_size=512, query_pre_attn_scalar=24, sliding_window=8,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"],
             rope_parameters={"sliding_attention": _rope(10000.0),
                              "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0}},
             hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
        "Gemma 3 text: (1 + w) RMSNorm (input, post-attention, pre- and post-feedforward), q/k RMSNorm, embeddings "
        "scaled by sqrt(hidden), scores scaled by query_pre_attn_scalar**-0.5 (24, not head_dim), sliding layers "
        "(window 8; the family's 5:1 pattern as 2:1) with rope 10k, full layers with rope 1M and linear scaling x8 "
        "(the 4B+ models'), no softcap, tied. vocab 512.",
        sliding_window=8, exercises=("one_plus_w_norm", "qk_norm", "sliding", "per_layer_rope", "query_pre_attn_scalar",
                                     "embed_scale", "tied")),
    "gemma2": ZooSpec(
        "Gemma2ForCausalLM", "Gemma2Config",
        dict(num_hidden_layers=3, head_dim=16, query_pre_attn_scalar=24, sliding_window=8,
             layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             attn_logit_softcapping=2.0, final_logit_softcapping=1.0, rope_parameters=_rope(10000.0),
             hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True),
        "Gemma 2: (1 + w) RMSNorm x4 per layer, attention logits softcapped (tanh) at 2.0 and final logits at 1.0 (the "
        "family's 50 / 30 are never reached by a tiny model's scores; its logits here are within about +-0.8), "
        "sliding (8) / full alternating, query_pre_attn_scalar 24, embeddings * sqrt(hidden), tied.",
        sliding_window=8, exercises=("one_plus_w_norm", "softcap", "sliding", "query_pre_attn_scalar", "embed_scale",
                                     "tied")),
    "mistral": ZooSpec(
        "MistralForCausalLM", "MistralConfig",
        dict(head_dim=16, sliding_window=16, rope_parameters=_rope(10000.0), tie_word_embeddings=False),
        "Mistral-7B-v0.1 style: a sliding window (16) on every layer, GQA, rope 10k, untied.",
        sliding_window=16, exercises=("sliding",)),
    "mixtral": ZooSpec(
        "MixtralForCausalLM", "MixtralConfig",
        dict(intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, rope_parameters=_rope(1000000.0),
             sliding_window=None, tie_word_embeddings=False),
        "Mixtral: sparse MoE in every layer (4 experts, top-2 of a softmax, renormalised), experts stored stacked, "
        "rope 1e6, no sliding window, untied. Saved as sharded safetensors (several files and an index).",
        moe=True, shard="60KB", exercises=("moe", "sharded")),
    "phi3": ZooSpec(
        "Phi3ForCausalLM", "Phi3Config",
        dict(max_position_embeddings=1024, original_max_position_embeddings=256,
             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75,
                              "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5],
                              "long_factor": [1.0, 2.0, 4.0, 8.0, 16.0, 32.0]},
             tie_word_embeddings=True),
        "Phi-4-mini shape on Phi3ForCausalLM: qkv_proj and gate_up_proj fused in the checkpoint, partial rotary 0.75 "
        "(12 of 16 dims), longrope (prompts under original_max_position_embeddings 256 use the short factors; the "
        "attention factor sqrt(1 + ln 4 / ln 256) scales cos/sin), tied (Phi-3 itself is untied).",
        exercises=("fused_qkv", "fused_gate_up", "partial_rotary", "longrope", "tied")),
    "phi3_rope": ZooSpec(
        "Phi3ForCausalLM", "Phi3Config",
        dict(rope_parameters=_rope(10000.0, partial_rotary_factor=0.75), tie_word_embeddings=False),
        "Phi-3-mini-4k / Phi-4 (no longrope) on Phi3ForCausalLM: qkv_proj and gate_up_proj fused in the checkpoint, "
        "partial rotary 0.75 (12 of 16 dims), untied.",
        exercises=("fused_qkv", "fused_gate_up", "partial_rotary")),
    "olmo2": ZooSpec(
        "Olmo2ForCausalLM", "Olmo2Config",
        dict(num_key_value_heads=4, rope_parameters=_rope(500000.0), tie_word_embeddings=False),
        "OLMo-2: RMSNorm after attention and after the MLP (post_attention_layernorm, post_feedforward_layernorm; no "
        "pre-norm), q/k RMSNorm over the whole projected width (64, not per head), MHA, rope 5e5, untied.",
        exercises=("post_norm", "qk_norm_full_width")),
    "glm4": ZooSpec(
        "Glm4ForCausalLM", "Glm4Config",
        dict(head_dim=16, attention_bias=True, partial_rotary_factor=0.5,
             rope_parameters=_rope(10000.0, partial_rotary_factor=0.5), rms_norm_eps=1e-5, tie_word_embeddings=False),
        "GLM-4: partial rotary (half of head_dim) with interleaved pairs (x[0::2], x[1::2]), q/k/v bias (no o_proj "
        "bias), fused gate_up_proj, four RMSNorms per layer (input; post_self_attn on the attention output; "
        "post_attention before the MLP; post_mlp on its output), untied.",
        exercises=("partial_rotary", "interleaved_rotary", "qkv_bias", "fused_gate_up", "post_norm")),
    "smollm3": ZooSpec(
        "SmolLM3ForCausalLM", "SmolLM3Config",
        dict(num_hidden_layers=4, rope_parameters=_rope(2000000.0), no_rope_layer_interval=4, use_sliding_window=False,
             tie_word_embeddings=True),
        "SmolLM3: NoPE layers (no_rope_layers [1, 1, 1, 0]: the 4th layer applies no rope), rope 2e6, tied.",
        exercises=("nope_layers", "tied")),
    "ernie4_5": ZooSpec(
        "Ernie4_5ForCausalLM", "Ernie4_5Config",
        dict(head_dim=16, rope_parameters=_rope(500000.0), use_bias=False, tie_word_embeddings=True),
        "ERNIE-4.5 dense (0.3B shape): interleaved rotary (cos/sin repeat-interleaved, rotate_half on pairs), rope "
        "5e5, tied.",
        exercises=("interleaved_rotary", "tied")),
    "ernie4_5_moe": ZooSpec(
        "Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig",
        dict(num_hidden_layers=3, head_dim=16, rope_parameters=_rope(500000.0), use_bias=False,
             moe_intermediate_size=32, moe_k=2, moe_num_experts=4, moe_num_shared_experts=1, moe_layer_start_index=1,
             moe_layer_end_index=2, moe_layer_interval=1, tie_word_embeddings=True),
        "ERNIE-4.5 MoE: layer 0 dense, layers 1-2 sparse (4 experts top-2 of a softmax, renormalised with "
        "moe_norm_min, experts chosen by softmax + e_score_correction_bias but weighted without it) plus one shared "
        "expert, interleaved rotary, tied.",
        moe=True, exercises=("moe", "score_correction_bias", "shared_expert", "dense_first_layer",
                             "interleaved_rotary", "tied")),
    "gpt_oss": ZooSpec(
        "GptOssForCausalLM", "GptOssConfig",
        dict(head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
             layer_types=["sliding_attention", "full_attention"], attention_bias=True,
             rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                              "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
             max_position_embeddings=131072, tie_word_embeddings=False),
        "gpt-oss: a learned attention sink per head (an extra softmax logit), sliding (8) / full alternating, q/k/v/o "
        "biases, yarn rope (factor 32, truncate False, attention factor), MoE in every layer (router with bias, top-2 "
        "then softmax over the two), experts stacked [E, in, out] with interleaved gate/up columns and biases, "
        "activation (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = clamp(gate, max 7), untied. "
        "max_position_embeddings is the family's 131072 (yarn's factor is relative to the original 4096).",
        moe=True, sliding_window=8, exercises=("sinks", "sliding", "attn_bias", "yarn", "moe", "router_bias",
                                               "clamped_swiglu")),
    "cohere2": ZooSpec(
        "Cohere2ForCausalLM", "Cohere2Config",
        dict(num_hidden_layers=3, head_dim=16, sliding_window=8, logit_scale=0.0625,
             layer_types=["sliding_attention", "sliding_attention", "full_attention"],
             rope_parameters=_rope(50000.0), tie_word_embeddings=True),
        "Command R7B / Cohere 2: LayerNorm that subtracts the mean (weight only, no bias), one norm feeding attention "
        "and MLP in parallel (x + attn(n) + mlp(n)), interleaved rotary on sliding layers (window 8, the family's 3:1 "
        "as 2:1) and no rope at all on the full layer, logits * logit_scale 0.0625, tied.",
        sliding_window=8, exercises=("layernorm", "parallel_block", "interleaved_rotary", "nope_layers", "sliding",
                                     "logit_scale", "tied")),
    "qwen2_moe": ZooSpec(
        "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
        dict(moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4, num_experts_per_tok=2,
             norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], qkv_bias=True,
             rope_parameters=_rope(1000000.0), use_sliding_window=False, tie_word_embeddings=False),
        "Qwen1.5/2-MoE: 4 experts top-2 of a softmax, not renormalised, plus a shared expert scaled by "
        "sigmoid(shared_expert_gate(x)), q/k/v bias, untied.",
        moe=True, exercises=("moe", "shared_expert_gate", "qkv_bias")),
    "granitemoe": ZooSpec(
        "GraniteMoeForCausalLM", "GraniteMoeConfig",
        dict(intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=12.0,
             residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=6.0,
             rope_parameters=_rope(10000.0), tie_word_embeddings=False),
        "Granite-3.0 MoE (1b-a400m's multipliers): embeddings * 12, each residual branch * 0.22, attention scores * "
        "1/head_dim (0.0625; the release's 0.015625 is 1/64 of its head_dim 64) instead of 1/sqrt(head_dim), logits "
        "/ 6, MoE 4 experts top-2 (softmax over the top-k) stored as input_linear (gate and up stacked) / "
        "output_linear. Untied (GraniteMoeConfig's default; the releases tie: tied, a tiny random Granite repeats "
        "one token).",
        moe=True, exercises=("multipliers", "moe", "tied"), embed_init_scale=1 / 12),
    "starcoder2": ZooSpec(
        "Starcoder2ForCausalLM", "Starcoder2Config",
        dict(sliding_window=16, use_bias=True, hidden_act="gelu_pytorch_tanh", rope_parameters=_rope(100000.0),
             tie_word_embeddings=True),
        "StarCoder2: LayerNorm with bias, non-gated MLP c_fc -> gelu(tanh) -> c_proj with biases, q/k/v/o biases, a "
        "sliding window (16) on every layer, rope 1e5, tied.",
        sliding_window=16, exercises=("layernorm_bias", "gelu_mlp", "attn_bias", "sliding", "tied")),
    "granite": ZooSpec(
        "GraniteForCausalLM", "GraniteConfig",
        dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=8.0,
             rope_parameters=_rope(10000.0), tie_word_embeddings=False),
        "Granite-3.0 dense (2b's multipliers): embeddings * 12, residual branches * 0.22, attention scores * "
        "1/head_dim (0.0625, as the release's 1/64 for head_dim 64), logits / 8. Untied (GraniteConfig's default; "
        "the releases tie, but tied, a tiny random Granite repeats one token).",
        exercises=("multipliers", "tied"), embed_init_scale=1 / 12),
}


@dataclass(frozen=True)
class UnsupportedSpec:
    model_cls: str
    config_cls: str
    kwargs: dict
    reason: str  # what a user should be told (the refusal's message should contain it)

    def config(self):
        import transformers

        return getattr(transformers, self.config_cls)(**self.kwargs)


UNSUPPORTED: dict[str, UnsupportedSpec] = {
    "t5": UnsupportedSpec(
        "T5ForConditionalGeneration", "T5Config",
        dict(vocab_size=256, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4,
             decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, initializer_factor=1.0),
        "encoder-decoder"),
    "mamba": UnsupportedSpec(
        "MambaForCausalLM", "MambaConfig",
        dict(vocab_size=256, hidden_size=64, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
             bos_token_id=1, eos_token_id=2, pad_token_id=0),
        "Mamba / state-space layers"),
}


def _draw_prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(3, ZOO_MIN_VOCAB, (n,), generator=g).tolist() for n in ZOO_PROMPT_LENGTHS]


ZOO_PROMPTS: list[list[int]] = _draw_prompts()  # ids in [3, 256): within every zoo vocab, no bos/eos/pad


# --- building


@contextlib.contextmanager
def one_thread():
    """torch on one intra-op thread for the block (restored after). The zoo's matmuls are tiny: a second thread only
    adds OpenMP hand-offs, and on a loaded 2-core machine spinning threads made this file's run 7x slower (60 s vs
    9 s). The oracle helpers run under it, so HF's numbers do not depend on the caller's thread count."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def constant_at_init(model: torch.nn.Module, name: str) -> float | None:
    """The perturbation scale of parameter `name` if init leaves it constant (norm weights and biases 0.3, gpt-oss's
    sinks 1.0, every other bias 0.1: linear, router, expert, e_score_correction_bias), else None."""
    owner_name, _, leaf = name.rpartition(".")
    owner = model.get_submodule(owner_name) if owner_name else model
    if "norm" in type(owner).__name__.lower() or "norm" in owner_name.rpartition(".")[2].lower():
        return 0.3
    if leaf == "sinks":
        return 1.0
    if "bias" in leaf:
        return 0.1
    return None


@torch.no_grad()
def perturb_constants(model: torch.nn.Module, seed: int = 1) -> list[str]:
    """Move every parameter that init leaves constant away from it (constant_at_init: + scale * randn), so a reader
    that ignores it, or reads it the wrong way ((1 + w) vs w, a missing bias), gives other logits. Norm gains become
    1 + 0.3 randn for ones-init norms and 0.3 randn around Gemma's zero init (a gain of 1 + 0.3 randn). Returns the
    names touched."""
    g = torch.Generator().manual_seed(seed)
    touched = []
    for name, p in model.named_parameters():
        scale = constant_at_init(model, name)
        if scale is not None:
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=torch.float32).to(p.dtype))
            touched.append(name)
    return touched


@one_thread()
def build_model(name: str, seed: int = 0):
    """ZOO[name] (or UNSUPPORTED[name]) as an in-memory fp32 model in eval mode, eager attention, constants perturbed:
    exactly what make_checkpoint saves."""
    import transformers

    spec = ZOO.get(name) or UNSUPPORTED[name]
    config = spec.config()
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if config.is_encoder_decoder:
            model = getattr(transformers, spec.model_cls)(config)
        else:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32,
                                                                  attn_implementation="eager")
    assert type(model).__name__ == spec.model_cls, (type(model).__name__, spec.model_cls)
    scale = getattr(spec, "embed_init_scale", None)
    if scale is None:
        scale = 0.25 if config.tie_word_embeddings else 1.0
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(scale)
    perturb_constants(model, seed + 1)
    return model.eval()


@one_thread()
def make_checkpoint(name: str, directory: str, seed: int = 0) -> str:
    """Build ZOO[name] (or UNSUPPORTED[name]) tiny, perturb its constants, save it into `directory` (made if
    missing) with save_pretrained as safetensors (sharded where the spec says). Returns `directory`."""
    spec = ZOO.get(name) or UNSUPPORTED[name]
    model = build_model(name, seed)
    os.makedirs(directory, exist_ok=True)
    kw = {"max_shard_size": spec.shard} if getattr(spec, "shard", None) else {}
    model.save_pretrained(directory, safe_serialization=True, **kw)
    return directory


# --- features that must matter


@dataclass(frozen=True)
class Mutation:
    """A way to get an architecture's feature wrong: config overrides for from_pretrained and/or an in-place edit of
    the loaded model. test_hf_zoo checks each changes HF's logits on ZOO_PROMPTS, so a path that ignores the feature
    cannot match HF on this material."""
    label: str
    config: dict = field(default_factory=dict)
    edit: object = None  # callable(model) -> None, under no_grad


def _norm_gain_read_as_w(model):  # a (1 + w) RMSNorm read as a plain w gain: 1 + (w - 1) = w
    for mod in model.modules():
        if "rmsnorm" in type(mod).__name__.lower():
            mod.weight.sub_(1.0)


def _no_sinks(model):
    for mod in model.modules():
        if hasattr(mod, "sinks"):
            mod.sinks.fill_(-1e30)


def _no_score_correction(model):
    for mod in model.modules():
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias.zero_()


def _no_shared_expert_gate(model):  # sigmoid(0): the shared expert always at half weight
    for mod in model.modules():
        if hasattr(mod, "shared_expert_gate"):
            mod.shared_expert_gate.weight.zero_()


def _no_biases(model):
    for name, p in model.named_parameters():
        if name.endswith("proj.bias") or name.endswith("c_fc.bias"):
            p.zero_()


_NO_WINDOW = Mutation("no sliding window", {"sliding_window": 4096})
FEATURE_MUTATIONS: dict[str, list[Mutation]] = {
    "gemma3": [_NO_WINDOW, Mutation("query_pre_attn_scalar = head_dim", {"query_pre_attn_scalar": 16}),
               Mutation("norm gain w, not 1 + w", edit=_norm_gain_read_as_w),
               Mutation("the local layers' rope on every layer", {"rope_parameters": {
                   "sliding_attention": _rope(10000.0), "full_attention": _rope(10000.0)}})],
    "gemma2": [_NO_WINDOW, Mutation("no attention softcap", {"attn_logit_softcapping": None}),
               Mutation("no final softcap", {"final_logit_softcapping": None}),
               Mutation("query_pre_attn_scalar = head_dim", {"query_pre_attn_scalar": 16})],
    "mistral": [_NO_WINDOW],
    "phi3": [Mutation("full rotary, no longrope", {"rope_parameters": _rope(10000.0, partial_rotary_factor=1.0)})],
    "glm4": [Mutation("full rotary", {"partial_rotary_factor": 1.0,
                                      "rope_parameters": _rope(10000.0, partial_rotary_factor=1.0)})],
    "smollm3": [Mutation("rope on every layer", {"no_rope_layers": [1, 1, 1, 1]})],
    "ernie4_5_moe": [Mutation("no e_score_correction_bias", edit=_no_score_correction)],
    "gpt_oss": [_NO_WINDOW, Mutation("no sinks", edit=_no_sinks)],
    "cohere2": [_NO_WINDOW, Mutation("logit_scale 1", {"logit_scale": 1.0})],
    "qwen2_moe": [Mutation("shared expert gate ignored (0.5)", edit=_no_shared_expert_gate)],
    "granitemoe": [Mutation("residual_multiplier 1", {"residual_multiplier": 1.0}),
                   Mutation("attention scaled 1/sqrt(head_dim)", {"attention_multiplier": 0.25})],
    "starcoder2": [_NO_WINDOW, Mutation("no linear biases", edit=_no_biases)],
    "granite": [Mutation("residual_multiplier 1", {"residual_multiplier": 1.0}),
                Mutation("embedding_multiplier 1", {"embedding_multiplier": 1.0}),
                Mutation("attention scaled 1/sqrt(head_dim)", {"attention_multiplier": 0.25}),
                Mutation("logits_scaling 1", {"logits_scaling": 1.0})],
}


@torch.no_grad()
@one_thread()
def mutated_logits(path: str, mutation: Mutation, token_ids: list[int]) -> torch.Tensor:
    """HF's fp32 logits [T, vocab] for token_ids from the checkpoint at `path` loaded with `mutation` applied."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                                     **mutation.config).eval()
    if mutation.edit is not None:
        mutation.edit(model)
    return model(torch.tensor([token_ids]), use_cache=False).logits[0].float()


# --- the oracle


@functools.lru_cache(maxsize=None)
def load_hf(path: str):
    """HF's own fp32 load of a saved zoo checkpoint, eager attention (the reference for sinks and softcaps),
    eval mode. Cached per path: treat it as read-only."""
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    return model.eval()


def _generation_config(model, max_new_tokens: int):
    from transformers import GenerationConfig

    return GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, use_cache=True,
                            num_beams=1, pad_token_id=model.config.pad_token_id or 0)


@torch.no_grad()
@one_thread()
def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF's greedy continuation (fp32, KV cache on, EOS not a stop) of each prompt, one at a time (no padding):
    exactly max_new_tokens ids per prompt.

    EOS is off by clearing it on the model's own generation_config for the call: generate() fills every field left
    None in the config it is given from the model's (so eos_token_id=None there does not switch EOS off), and
    min_new_tokens would mask EOS's logit instead (a different greedy token where EOS is the argmax)."""
    model = load_hf(path)
    saved = model.generation_config
    model.generation_config = copy.deepcopy(saved)
    model.generation_config.eos_token_id = None
    out = []
    try:
        for prompt in prompts:
            ids = torch.tensor([prompt])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                gen = model.generate(ids, attention_mask=torch.ones_like(ids),
                                     generation_config=_generation_config(model, max_new_tokens))
            new = gen[0, len(prompt):].tolist()
            assert len(new) == max_new_tokens, f"HF stopped after {len(new)} of {max_new_tokens} tokens"
            out.append(new)
    finally:
        model.generation_config = saved
    return out


@torch.no_grad()
@one_thread()
def hf_logits(path: str, token_ids: list[int], all_positions: bool = False) -> torch.Tensor:
    """HF's fp32 logits for one sequence (no cache): the last position's [vocab], or every position's [T, vocab]."""
    logits = load_hf(path)(torch.tensor([token_ids]), use_cache=False).logits[0].float()
    return logits if all_positions else logits[-1]


def top2_gap(logits: torch.Tensor) -> tuple[int, int, float]:
    """(top-1 id, top-2 id, relative gap (l1 - l2) / max(|l1|, |l2|, 1e-30)) of one position's logits."""
    vals, idx = torch.topk(logits.float(), 2)
    l1, l2 = vals.tolist()
    return idx[0].item(), idx[1].item(), (l1 - l2) / max(abs(l1), abs(l2), 1e-30)


def is_tie(logits: torch.Tensor, a: int, b: int, rel: float = 1e-5) -> bool:
    """Whether tokens a and b are both acceptable greedy picks at this position: one is the argmax and the other's
    logit is within `rel` (relative to the larger magnitude) of it."""
    top = int(torch.argmax(logits))
    if top not in (a, b):
        return False
    la, lb = logits[a].item(), logits[b].item()
    return abs(la - lb) <= rel * max(abs(la), abs(lb), 1e-30)


def greedy_matches_hf(path: str, prompt: list[int], expected: list[int], got: list[int],
                      rel: float = 1e-5) -> tuple[bool, str]:
    """Tie-aware comparison of a greedy continuation with HF's (`expected`, from hf_greedy): equal, or equal up to a
    first difference where HF's logits (recomputed on the common prefix) tie the two tokens within `rel`; after it
    the sequences may legitimately diverge. Returns (ok, a description for the assertion message)."""
    if len(got) != len(expected):
        return False, f"{len(got)} tokens, HF has {len(expected)}"
    if got == expected:
        return True, "identical"
    pos = next(i for i, (x, y) in enumerate(zip(expected, got)) if x != y)
    logits = hf_logits(path, prompt + expected[:pos])
    t1, t2, gap = top2_gap(logits)
    ok = is_tie(logits, expected[pos], got[pos], rel)
    what = "tie" if ok else "mismatch"
    return ok, (f"{what} at generated position {pos}: HF {expected[pos]} ({logits[expected[pos]].item():.6g}), got "
                f"{got[pos]} ({logits[got[pos]].item():.6g}); HF top-2 {t1}/{t2}, relative gap {gap:.3g}")


# --- fixtures


def hf_zoo_checkpoint_factory(tmp_path_factory):
    """The body of conftest's session fixture `hf_zoo_checkpoint`: name -> path, each built once per session."""
    cache: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in cache:
            cache[name] = make_checkpoint(name, str(tmp_path_factory.mktemp(f"hf-zoo-{name}")))
        return cache[name]

    return make
