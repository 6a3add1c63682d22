"""absorb_mla: multi-head latent attention from the expanded form to the one chosen per step (DeepSeek-V2 / V3).

Matches: graphinfer::mla_attention(q, latent_cache, kv_b_weight, ...) whose kv_b_weight is a parameter read
(kv_b_proj's weight [H * (N + V), L], this rank's heads).
Produces: W_UK [H, N, L] and W_UV [H, L, V], split from kv_b_proj's weight once here and held by the graph, and
graphinfer::mla_attention_auto(q_nope, q_pe, latent_cache, W_UK, W_UV, ..., expand_min_query_len, expand_max_tokens),
which runs each step in one of two forms (graphinfer/ops/mla.py):
  - absorbed: q_latent = q_nope x W_UK; o = mla_latent_attention(q_latent, q_pe, latent_cache) (multi-query over
    the cached rows [c, k_pe], value c); out = o x W_UV. The same attention: q_nope . (W_UK c) = (q_nope W_UK) . c
    for every cached latent c, and W_UV applied to the weighted sum of c is the weighted sum of W_UV c. Attention
    reads L + R numbers per cached token instead of expanding every cached latent to H heads each step (vLLM's MLA
    decode path);
  - expanded: the context's latents through W_UK / W_UV once, then per-head attention of dimension N + R (vLLM's MLA
    prefill path), which does fewer FLOPs once a request brings many query rows.
The choice is the pass's arithmetic, written into the graph: per request with n query rows over a context of c
tokens, absorbed costs n c H (2L + R) + n H L (N + V) multiply-adds and expanded c H L (N + V) + 2 n c H D
(D = max(N + R, V), V padded to D); expanded wins for every c once n >= L (N + V) / (2L + R - 2D) (187 for
DeepSeek-V3), so expand_min_query_len is that (never, where the denominator is <= 0), unless
GRAPHINFER_MLA_EXPAND_MIN_QUERY_LEN sets it. expand_max_tokens bounds the expanded form's temporary K/V to
MLA_EXPAND_WORKSPACE_BYTES; a longer context takes the absorbed form.
Declines: a kv_b weight that is not a parameter read (say, a quantized kv_b_proj).
"""
import math
import operator

import torch
from torch import fx

from graphinfer import envs
from graphinfer.passes.base import Pass
from graphinfer.passes.match import arg, get_param, is_op
from graphinfer.passes.utils import GRAPHINFER


MLA_EXPAND_WORKSPACE_BYTES = 256 << 20  # the expanded form's temporary K + V per layer call
NEVER = 2 ** 31 - 1


def expand_min_query_len(L: int, N: int, R: int, V: int) -> int:
    """Query rows per request from which the expanded form does fewer multiply-adds (the module docstring)."""
    if override := envs.GRAPHINFER_MLA_EXPAND_MIN_QUERY_LEN:
        return int(override)
    denominator = 2 * L + R - 2 * max(N + R, V)
    return NEVER if denominator <= 0 else math.ceil(L * (N + V) / denominator)


class AbsorbMLAPass(Pass):
    name = "absorb_mla"
    description = "MLA expanded through kv_b_proj -> absorbed: q_nope x W_UK, multi-query attention on the latent, x W_UV"

    def apply(self, gm: fx.GraphModule) -> int:
        matches = 0
        for node in list(gm.graph.nodes):
            if not is_op(node, GRAPHINFER.mla_attention):
                continue
            q, cache, w, tables, starts, lens = (arg(node, i, n) for i, n in enumerate(
                ("query", "kv_cache", "kv_b_weight", "block_tables", "query_start_loc", "seq_lens")))
            scale, N, V = arg(node, 6, "scale"), arg(node, 7, "qk_nope_head_dim"), arg(node, 8, "v_head_dim")
            if not (isinstance(w, fx.Node) and w.op == "get_attr"):
                self.decline(f"{node.name}: kv_b_proj's weight is not a parameter read")
                continue
            weight = get_param(gm, w)
            H, L = weight.shape[0] // (N + V), weight.shape[1]
            R = get_param(gm, cache).shape[-1] - L  # the cache row: [c (L), k_pe (R)]
            per_head = weight.detach().view(H, N + V, L)
            base = w.target.replace(".", "_")
            gm.register_buffer(f"{base}_w_uk", per_head[:, :N].contiguous())  # [H, N, L]
            gm.register_buffer(f"{base}_w_uv", per_head[:, N:].transpose(1, 2).contiguous())  # [H, L, V]
            g = gm.graph
            with g.inserting_before(node):
                w_uk, w_uv = g.get_attr(f"{base}_w_uk"), g.get_attr(f"{base}_w_uv")
                q_nope = g.call_function(operator.getitem, (q, (Ellipsis, slice(None, N))))
                q_pe = g.call_function(operator.getitem, (q, (Ellipsis, slice(N, None))))
                out = g.call_function(GRAPHINFER.mla_attention_auto.default, (
                    q_nope, q_pe, cache, w_uk, w_uv, tables, starts, lens, scale,
                    expand_min_query_len(L, N, R, V),
                    MLA_EXPAND_WORKSPACE_BYTES // (H * max(N + R, V) * 2 * weight.element_size())))
            node.replace_all_uses_with(out)
            g.erase_node(node)
            matches += 1
        return matches
