"""absorb_mla: multi-head latent attention from the expanded form to the absorbed one (DeepSeek-V2 / V3).

Matches: graphinfer::mla_attention(q, latent_cache, kv_b_weight, ...) whose kv_b_weight is a parameter read
(kv_b_proj's weight [H * (N + V), L], this rank's heads).
Produces: W_UK [H, N, L] and W_UV [H, L, V], split from kv_b_proj's weight once here and held by the graph; then
    q_latent = q_nope x W_UK                                    (per head: the query in the latent space)
    o = mla_latent_attention(q_latent, q_pe, latent_cache)  (multi-query over the cached rows [c, k_pe]; value c)
    out = o x W_UV                                              (per head: the value)
which is the same attention: q_nope . (W_UK c) = (q_nope W_UK) . c for every cached latent c, and the value
W_UV c summed with the same weights is W_UV applied to the weighted sum of c. Attention then reads L + R numbers per
cached token instead of expanding every cached latent to H heads through kv_b_proj each step, and runs on the
latent attention kernels (graphinfer/ops/mla.py; vLLM's MLA decode path). All steps take this form for now; vLLM keeps the
expanded one for long prefills, where it does fewer FLOPs.
Declines: a kv_b weight that is not a parameter read (say, a quantized kv_b_proj).
"""
import operator

import torch
from torch import fx

from graphinfer.passes.base import Pass
from graphinfer.passes.match import arg, get_param, is_op
from graphinfer.passes.utils import GRAPHINFER


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
            per_head = weight.detach().view(H, N + V, L)
            base = w.target.replace(".", "_")
            gm.register_buffer(f"{base}_w_uk", per_head[:, :N].contiguous())  # [H, N, L]
            gm.register_buffer(f"{base}_w_uv", per_head[:, N:].transpose(1, 2).contiguous())  # [H, L, V]
            g = gm.graph
            with g.inserting_before(node):
                w_uk, w_uv = g.get_attr(f"{base}_w_uk"), g.get_attr(f"{base}_w_uv")
                q_nope = g.call_function(operator.getitem, (q, (Ellipsis, slice(None, N))))
                q_pe = g.call_function(operator.getitem, (q, (Ellipsis, slice(N, None))))
                q_latent = g.call_method("transpose", (g.call_function(
                    torch.bmm, (g.call_method("transpose", (q_nope, 0, 1)), w_uk)), 0, 1))
                o_latent = g.call_function(GRAPHINFER.mla_latent_attention.default,
                                           (q_latent, q_pe, cache, tables, starts, lens, scale))
                out = g.call_method("transpose", (g.call_function(
                    torch.bmm, (g.call_method("transpose", (o_latent, 0, 1)), w_uv)), 0, 1))
            node.replace_all_uses_with(out)
            g.erase_node(node)
            matches += 1
        return matches
