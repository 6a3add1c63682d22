"""Tensor parallel for transformers' modeling code (model_impl="transformers"): the config's own plan,
`base_model_tp_plan`, applied with graphinfer's parallel layers, as vLLM's Transformers backend does.

The plan maps module paths of the base model (`layers.*.self_attn.q_proj`) to a style. "colwise" becomes a
ColumnParallelLinear (output features split, no communication), "rowwise" a RowParallelLinear (input features split,
partial sums all-reduced: a graphinfer::all_reduce node in the captured graph). "colwise_gather_output" (a layer whose
full output the code needs: Phi-3's fused qkv_proj, OLMo 2's q/k norms over every head) splits the weight and
all-gathers the output; "rowwise_split_input" takes the rank's slice of a whole input and all-reduces (vLLM's
colwise_rep / rowwise_rep). Other styles keep the layer whole on every rank, and the plan's entries for non-Linear
modules (norms, stacked experts) are left alone.
transformers' attention code reshapes with `-1` heads, so a rank's q/k/v run its share of the heads unchanged. With
fewer KV heads than ranks, k/v are replicated (rank r holds KV head r * kv // tp), as in graphinfer's own models.
The input embedding and the LM head are split over the vocabulary when both are plain layers (a scaled embedding,
Gemma's, stays whole, and so does the head tied to it).
"""
import re

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from graphinfer.distributed import parallel_state as ps
from graphinfer.distributed.communication_op import tensor_model_parallel_all_gather
from graphinfer.errors import InvalidConfigError
from graphinfer.models.parallel_layers import (ColumnParallelLinear, ParallelLMHead, RowParallelLinear,
                                               VocabParallelEmbedding)


def tp_plan(config) -> dict[str, str]:
    """The config's base_model_tp_plan, or InvalidConfigError at tp > 1 when transformers declares none."""
    text = config.get_text_config()
    plan = getattr(text, "base_model_tp_plan", None) or {}
    if not plan:
        raise InvalidConfigError(
            f"{config.architectures} through transformers' modeling code: transformers declares no tensor-parallel "
            f"plan (base_model_tp_plan) for {type(text).__name__}, so graphinfer cannot tell how to split its "
            f"layers; run it at tensor_parallel_size=1 (or with data parallel).")
    return plan


def _pattern(key: str) -> re.Pattern:
    return re.compile(re.escape(key).replace(r"\*", r"\d+"))


class GatheredColumnParallelLinear(ColumnParallelLinear):
    """colwise_gather_output: output features split, the whole output all-gathered (in rank order: the layer's)."""
    has_collective = True

    def forward(self, x: Tensor) -> Tensor:
        return tensor_model_parallel_all_gather(F.linear(x, self.weight, self.bias), -1)


class SplitInputRowParallelLinear(RowParallelLinear):
    """rowwise_split_input: the input is whole on every rank, which takes its slice of the features (by an index
    buffer, so every rank's graph is the same code) before the row-parallel product."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__(in_features, out_features, bias)
        n = self.in_features
        self.register_buffer("input_index", torch.arange(ps.tp_rank() * n, (ps.tp_rank() + 1) * n), persistent=False)

    def reset_buffers(self, device) -> None:  # models/layers.init_buffers
        n = self.in_features
        self.input_index = torch.arange(ps.tp_rank() * n, (ps.tp_rank() + 1) * n, device=device)

    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.index_select(-1, self.input_index))


def _linear(old: nn.Linear, style: str, kv_out: int, kv_heads: int) -> nn.Linear | None:
    """The parallel layer that replaces `old` for `style` (None: stays whole)."""
    bias, tp = old.bias is not None, ps.tp_size()
    if style == "colwise":
        shards = kv_heads if old.out_features == kv_out and kv_heads < tp else None  # replicated KV heads
        return ColumnParallelLinear(old.in_features, old.out_features, bias, shards)
    if style == "rowwise":
        return RowParallelLinear(old.in_features, old.out_features, bias)
    if style == "colwise_gather_output" and old.out_features % tp == 0:
        return GatheredColumnParallelLinear(old.in_features, old.out_features, bias)
    if style == "rowwise_split_input" and old.in_features % tp == 0:
        return SplitInputRowParallelLinear(old.in_features, old.out_features, bias)
    return None


def tensor_parallel(hf_model: nn.Module) -> list[str]:
    """Replace, in transformers' *ForCausalLM, the layers its plan splits by this rank's parallel layers, on meta
    in the model's dtype (their buffers: init_buffers); the replaced paths."""
    config = hf_model.config.get_text_config()
    plan = [(_pattern(k), style) for k, style in tp_plan(hf_model.config).items()]
    heads, dtype = config.num_attention_heads, hf_model.dtype
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    base, replaced = hf_model.model, []
    for path, module in list(base.named_modules()):
        if type(module) is not nn.Linear:
            continue
        style = next((s for p, s in plan if p.fullmatch(path)), None)
        with torch.device("meta"):
            new = _linear(module, style, kv_heads * head_dim, kv_heads) if style else None
        if new is not None:
            parent, _, name = path.rpartition(".")
            setattr(base.get_submodule(parent), name, new.to(dtype))
            replaced.append(f"model.{path}")
    embed, head = base.get_input_embeddings(), hf_model.get_output_embeddings()
    if type(embed) is nn.Embedding and type(head) is nn.Linear and head.bias is None:
        with torch.device("meta"):  # the embedding's vocabulary offset: init_buffers
            new_embed = VocabParallelEmbedding(embed.num_embeddings, embed.embedding_dim)
            new_head = ParallelLMHead(head.in_features, head.out_features)
        base.set_input_embeddings(new_embed.to(dtype))
        hf_model.set_output_embeddings(new_head.to(dtype))
        replaced += ["model.embed_tokens", "lm_head"]
    return replaced
