"""torch_npu fused-op implementations of the graphinfer:: ops (Ascend), as thin adapters.

Each adapter has exactly its graphinfer op's signature and marshals arguments (layouts, dtypes, host
lists) for one torch_npu op or op chain; the semantics relied on are the torch_npu / CANN documentation and
vllm-ascend's use of each op (docs/ascend.md lists them with sources). `NpuOps(torch_npu)` takes the module
to call, or looks `torch_npu` up on first use: importing this file never imports torch_npu, and the tests
pass the emulation in tests/npu_emulation.py instead.

Not run on NPU hardware by this project: verified against that emulation only (tools/npu_smoke.py checks
the single-device adapters against the reference ops on an Atlas A2/A3; the MC2 expert-parallel pair needs
a multi-card EP group and has run only under the emulation, on two gloo ranks).
"""
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from graphinfer.distributed import parallel_state as ps
from graphinfer.distributed.communication_op import combine_metadata_size, ep_combine, ep_dispatch
from graphinfer.ops.npu.quant import QUANT_NPU_OPS, NpuQuantOps
from graphinfer.ops.qk_norm_rope import chain_cache_write

NPU_OPS = ("rms_norm", "add_rms_norm", "rotary_embedding", "qk_norm_rope", "qk_norm_rope_cache", "silu_and_mul",
           "reshape_and_cache", "paged_attention", "concat_and_cache_mla", "mla_latent_attention", "fused_moe", "fused_experts", "ep_dispatch", "ep_combine",
           *QUANT_NPU_OPS)  # quantization: ops/npu/quant.py
MASK_SIZE = 2048  # FIA sparse_mode 2/3/4 take this fixed-size compressed causal mask
A2_SOCS, A3_SOCS = range(220, 226), range(250, 256)  # torch_npu.npu.get_soc_version(), mapped as vllm-ascend does


def mc2_fits(soc_version: int, tokens: int, top_k: int, hidden: int, dtype: torch.dtype, num_experts: int,
             ep_size: int) -> bool:
    """Whether npu_moe_distribute_dispatch / _combine take this EP step: their documented limits for the
    unquantised form without TP or shared-expert ranks. Outside them the ep adapters run the all_to_all reference
    (vllm-ascend likewise leaves MC2 for all-gather / all-to-all)."""
    local = num_experts // ep_size
    if not (dtype in (torch.bfloat16, torch.float16) and num_experts % ep_size == 0 and num_experts <= 512
            and tokens > 0):
        return False
    if soc_version in A2_SOCS:
        return (ep_size in (16, 32, 64) and local <= 24 and tokens <= 256 and top_k <= 16 and hidden <= 7168
                and hidden % 32 == 0)
    if soc_version in A3_SOCS:
        return ep_size in (8, 16, 32, 64, 128, 144, 256, 288) and tokens <= 512 and top_k <= 8 and hidden == 7168
    return False


def hccl_comm_name(group) -> str:
    """The name MC2 ops take for a process group's HCCL communicator (torch_npu documents the global rank)."""
    return group._get_backend(torch.device("npu")).get_hccl_comm_name(dist.get_rank())


def _mc2_expert_ids(topk_ids: Tensor) -> Tensor:
    """int32 ids, the K of a row distinct as MC2 requires: a row with a repeat (only sequence_parallel_chunk's zero
    padding has one, and its weights are 0) goes to experts 0..K-1 instead."""
    ids = topk_ids.to(torch.int32)
    ordered = ids.sort(dim=-1).values
    repeat = (ordered[:, 1:] == ordered[:, :-1]).any(dim=-1, keepdim=True)
    return torch.where(repeat, torch.arange(ids.shape[1], dtype=torch.int32, device=ids.device), ids)


class NpuOps(NpuQuantOps):
    """The adapters, bound to one torch_npu module; `table()` maps graphinfer op name -> adapter (the quantization
    ones are inherited from ops/npu/quant.py)."""

    def __init__(self, torch_npu=None):
        self._torch_npu = torch_npu
        self._masks: dict[torch.device, Tensor] = {}
        self._soc_version: int | None = None
        self._comm_names: dict[object, str] = {}  # process group -> its HCCL communicator's name
        self.graph_params = FiaGraphParams(self)
        self._init_quant()
        # No torch_npu op does it either: the qk_norm_rope and reshape_and_cache adapters in turn (a single launch
        # is graphinfer's Triton kernel: kernels="torch_npu,qk_norm_rope_cache=triton").
        self.qk_norm_rope_cache = chain_cache_write(self.qk_norm_rope, self.reshape_and_cache, __name__)

    @property
    def torch_npu(self):
        if self._torch_npu is None:
            import torch_npu

            self._torch_npu = torch_npu
        return self._torch_npu

    def table(self) -> dict[str, Callable]:
        return {name: getattr(self, name) for name in NPU_OPS}

    # ----- norms, activation -----
    def rms_norm(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return self.torch_npu.npu_rms_norm(x, weight, epsilon=eps)[0]  # -> (y, rstd)

    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        y, _, new_residual = self.torch_npu.npu_add_rms_norm(x, residual, weight, epsilon=eps)  # -> (y, rstd, x1 + x2)
        return y, new_residual

    def silu_and_mul(self, x: Tensor) -> Tensor:
        return self.torch_npu.npu_swiglu(x, dim=-1)  # silu(first half) * second half: w13 = cat(gate, up)

    # ----- rotary -----
    def rotary_embedding(self, positions: Tensor, query: Tensor, key: Tensor, head_size: int, cos_sin_cache: Tensor,
                         is_neox: bool) -> tuple[Tensor, Tensor]:
        # npu_rotary_mul, not npu_apply_rotary_pos_emb: it is out-of-place like this op, has an 'interleave'
        # (GPT-J) mode besides 'half' (neox), and no head_dim limit (apply_rotary_pos_emb: D 64/128, 'half' only).
        cos, sin = cos_sin_cache[positions].to(query.dtype).chunk(2, dim=-1)  # [T, rot_dim / 2] each
        if is_neox:
            cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
        else:
            cos, sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
        r1, r2 = cos[None, :, None, :], sin[None, :, None, :]  # 1S1D for a BSND input with B = 1, S = T
        mode = "half" if is_neox else "interleave"
        return self._rope(query, r1, r2, head_size, mode), self._rope(key, r1, r2, head_size, mode)

    def _rope(self, x: Tensor, r1: Tensor, r2: Tensor, head_size: int, mode: str) -> Tensor:
        rot_dim = r1.shape[-1]
        heads = x.reshape(x.shape[0], -1, head_size)
        out = self.torch_npu.npu_rotary_mul(heads[..., :rot_dim].contiguous().unsqueeze(0), r1, r2, rotary_mode=mode)[0]
        if rot_dim < head_size:  # partial rotary: the tail of each head passes through
            out = torch.cat((out, heads[..., rot_dim:]), dim=-1)
        return out.reshape(x.shape)

    def qk_norm_rope(self, qkv: Tensor, num_heads: int, num_kv_heads: int, head_size: int, q_weight: Tensor,
                     k_weight: Tensor, eps: float, positions: Tensor, cos_sin_cache: Tensor,
                     is_neox: bool) -> tuple[Tensor, Tensor, Tensor]:
        # The chain it replaces, on torch_npu ops: npu_rms_norm per q / k head, then the rotary adapter above
        # (npu_rotary_mul). torch_npu has no one op for it; vllm-ascend's fused version is a Triton-Ascend kernel,
        # which is graphinfer's Triton kernel here: kernels="torch_npu,qk_norm_rope=triton".
        T = qkv.shape[0]
        q, k, v = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
        q = self.rms_norm(q.view(T, num_heads, head_size), q_weight, eps).view(T, -1)
        k = self.rms_norm(k.view(T, num_kv_heads, head_size), k_weight, eps).view(T, -1)
        q, k = self.rotary_embedding(positions, q, k, head_size, cos_sin_cache, is_neox)
        return q, k, v.clone(memory_format=torch.contiguous_format)  # a copy: an op's output never aliases its input

    # ----- KV cache write -----
    def reshape_and_cache(self, key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor,
                          slot_mapping: Tensor) -> None:
        # npu_scatter_pa_kv_cache documents slots in [0, num_blocks * block_size - 1] and does not document skipping
        # -1 (vllm-ascend relies on it anyway). Padded rows are redirected, on device, to a write of the same call:
        # the first real row's slot with that row's K/V, or (no real row) slot 0 with what slot 0 already holds.
        valid = slot_mapping >= 0
        first = torch.argmax(valid.to(torch.int32))  # the first real row, 0 if none
        any_real = valid[first]
        k_flat, v_flat = key_cache.view(-1, *key_cache.shape[2:]), value_cache.view(-1, *value_cache.shape[2:])
        pad_slot = torch.where(any_real, slot_mapping[first], torch.zeros_like(slot_mapping[first]))
        pad_k = torch.where(any_real, key[first].to(key_cache.dtype), k_flat[0])
        pad_v = torch.where(any_real, value[first].to(value_cache.dtype), v_flat[0])
        rows = valid[:, None, None]
        self.torch_npu.npu_scatter_pa_kv_cache(
            torch.where(rows, key.to(key_cache.dtype), pad_k).contiguous(),
            torch.where(rows, value.to(value_cache.dtype), pad_v).contiguous(),
            key_cache, value_cache, torch.where(valid, slot_mapping, pad_slot).contiguous(),
            cache_mode="Norm")  # ND cache [num_blocks, block_size, num_kv_heads, head_size]

    # ----- attention -----
    def paged_attention(self, query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor,
                        query_start_loc: Tensor, seq_lens: Tensor, scale: float, sliding_window: int = 0,
                        softcap: float = 0.0, sinks: Tensor | None = None) -> Tensor:
        """npu_fused_infer_attention_score as vllm-ascend calls it: TND query, paged KV viewed as
        (num_blocks, block_size, num_kv_heads * head_size), cumulative query lengths, per-request KV lengths,
        sparse_mode 3 (right-down causal) with the 2048x2048 compressed mask.

        Calls with a sliding window, softcap or sinks run graphinfer's Triton kernel (Triton-Ascend; it reads its
        lengths on device, so it is capture-safe as it is): FIA has no softcap, and its band mode (sparse_mode 4 with
        pre_tokens / next_tokens) and _v2's learnable_sink would each need their conventions (where the window's edge
        falls, the sink's dtype) confirmed on hardware, which this project has no access to."""
        if sliding_window > 0 or softcap > 0 or sinks is not None:
            from graphinfer.ops.triton.attention import paged_attention as triton_paged_attention

            return triton_paged_attention(query, key_cache, value_cache, block_tables, query_start_loc, seq_lens, scale,
                                          sliding_window, softcap, sinks)
        num_blocks, block_size, num_kv_heads, _ = key_cache.shape
        paged = (num_blocks, block_size, -1)  # (blocknum, blocksize, H = kv_heads * head_size)
        kwargs = dict(key=key_cache.view(paged), value=value_cache.view(paged),
                      atten_mask=self._causal_mask(query.device), block_table=block_tables, input_layout="TND",
                      block_size=block_size, num_heads=query.shape[1], num_key_value_heads=num_kv_heads,
                      scale=scale, sparse_mode=3)
        if self.graph_params.is_capturing:
            out = self.graph_params.capture(query, kwargs, num_reqs=seq_lens.shape[0])
            return torch.where((seq_lens > 0)[:, None, None], out, 0.0)  # decode graphs: row i is request i
        if self.torch_npu.npu.is_current_stream_capturing():
            raise RuntimeError("graphinfer's torch_npu paged_attention (FIA) takes host lengths: it can be captured "
                               "only through graphinfer's FULL_DECODE_ONLY decode graphs, which patch them per replay. "
                               "Use kernels='torch_npu,paged_attention=triton' under other graph capture.")
        q_cum, kv_lens, q_lens, empty = self._host_lengths(query_start_loc, seq_lens)
        rows = q_cum[-1] if q_cum else 0  # query rows past the last request (piecewise padding) come out 0
        out, _ = self.torch_npu.npu_fused_infer_attention_score(
            query[:rows].contiguous(), **kwargs, actual_seq_lengths=q_cum, actual_seq_lengths_kv=kv_lens)
        if empty.any():
            # Requests with no context (padded rows) attend to nothing; FIA got a length of >= 1 for them: zero them.
            keep = torch.from_numpy(np.repeat(~empty, q_lens)).to(out.device, non_blocking=True)
            out = torch.where(keep[:, None, None], out, 0.0)
        if rows < query.shape[0]:
            out = torch.cat((out, out.new_zeros(query.shape[0] - rows, *out.shape[1:])))
        return out

    # ----- MLA (DeepSeek): the latent cache [num_blocks, block_size, 1, L + R] -----
    def concat_and_cache_mla(self, kv_c: Tensor, k_pe: Tensor, kv_cache: Tensor, slot_mapping: Tensor) -> None:
        # npu_scatter_nd_update_ on the cache viewed as rows [slots, L + R]: row slot_mapping[i] = [kv_c[i], k_pe[i]].
        # Indices must be in range (no documented skip of -1): padded rows are redirected on device as
        # reshape_and_cache's are (the first real row's slot and row again, or slot 0 with what it holds).
        rows_cache = kv_cache.view(-1, kv_cache.shape[-1])
        rows = torch.cat((kv_c, k_pe), dim=-1).to(kv_cache.dtype)
        valid = slot_mapping >= 0
        first = torch.argmax(valid.to(torch.int32))
        any_real = valid[first]
        pad_slot = torch.where(any_real, slot_mapping[first], torch.zeros_like(slot_mapping[first]))
        pad_row = torch.where(any_real, rows[first], rows_cache[0])
        slots = torch.where(valid, slot_mapping, pad_slot).to(torch.int64).view(-1, 1)
        self.torch_npu.npu_scatter_nd_update_(rows_cache, slots.contiguous(),
                                              torch.where(valid[:, None], rows, pad_row).contiguous())

    def mla_latent_attention(self, q_latent: Tensor, q_pe: Tensor, kv_cache: Tensor, block_tables: Tensor,
                             query_start_loc: Tensor, seq_lens: Tensor, scale: float) -> Tensor:
        """FIA in its plain form through the paged_attention adapter: query [q_latent, q_pe] (T, H, L + R), the latent
        cache as key and value with one KV head of L + R, the output's first L columns.

        vllm-ascend calls FIA's MLA form instead (query_rope / key_rope, key = value = the nope cache), but with the
        nope and rope parts in two cache tensors: FIA documents no non-contiguous key, and graphinfer's latent cache
        is one [num_blocks, block_size, 1, L + R] tensor, whose parts are strided views. So this reads the rope tail
        as value too, as the reference does. UNVERIFIED: that FIA takes a head dim of L + R (576 for DeepSeek-V3);
        the default kernel choice for this op is graphinfer's Triton kernel (docs/ascend.md, MLA)."""
        query = torch.cat((q_latent, q_pe.to(q_latent.dtype)), dim=-1)
        return self.paged_attention(query, kv_cache, kv_cache, block_tables, query_start_loc, seq_lens,
                                    scale)[..., :q_latent.shape[-1]]

    def _causal_mask(self, device: torch.device) -> Tensor:
        if device not in self._masks:  # 1 = masked (the strict upper triangle), int8 as vllm-ascend passes it
            self._masks[device] = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, device=device), diagonal=1).to(torch.int8)
        return self._masks[device]

    @staticmethod
    def _host_lengths(query_start_loc: Tensor, seq_lens: Tensor):
        """(cumulative query lengths, per-request KV lengths >= 1, query lengths, empty-request mask) on the host:
        FIA takes host lists (SymInt[]). One device-to-host copy per call: graphinfer's attention metadata holds
        device tensors only (a host copy there would spare eager steps this per-layer sync)."""
        both = torch.cat((query_start_loc.to(seq_lens.dtype), seq_lens)).cpu().numpy().astype(np.int64)
        starts, lens = both[:query_start_loc.shape[0]], both[query_start_loc.shape[0]:]
        q_lens = np.diff(starts)
        empty = lens <= 0
        kv = np.where(empty, np.maximum(q_lens, 1), lens)  # a padded row reads its (zeroed) block-table row instead
        return starts[1:].tolist(), kv.tolist(), q_lens, empty

    # ----- MoE -----
    def fused_moe(self, hidden: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor, top_k: int,
                  renormalize: bool) -> Tensor:
        tnpu = self.torch_npu
        # Softmax routing: npu_moe_gating_top_k_softmax is exactly softmax -> top-k (npu_moe_gating_top_k targets
        # grouped / sigmoid routing and supports renorm=0 only). fp32 in, as the reference routes in fp32.
        weights, ids, _ = tnpu.npu_moe_gating_top_k_softmax(router_logits.float(), None, k=top_k)
        if renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return self.fused_experts(hidden, ids, weights.to(hidden.dtype), w13, w2)

    def fused_experts(self, hidden: Tensor, topk_ids: Tensor, topk_weights: Tensor, w13: Tensor, w2: Tensor) -> Tensor:
        tnpu, weights, ids = self.torch_npu, topk_weights, topk_ids.to(torch.int32)  # routing v2 takes int32 ids
        num_tokens, top_k, num_experts = hidden.shape[0], topk_ids.shape[1], w13.shape[0]
        # Dropless dispatch: rows sorted by expert; per-expert counts (expert_tokens_num_type=1) for the matmuls.
        x, row_idx, counts, _ = tnpu.npu_moe_init_routing_v2(
            hidden, ids, active_num=num_tokens * top_k, expert_num=num_experts, expert_tokens_num_type=1,
            expert_tokens_num_flag=True, active_expert_range=[0, num_experts], quant_mode=-1)
        # weight i is (K, N) for x @ w: pass transposed views of w13 [E, 2I, H] / w2 [E, H, I] (gmm accepts them).
        gate_up = tnpu.npu_grouped_matmul([x], [w13.transpose(1, 2)], group_list=counts, group_list_type=1,
                                          group_type=0, split_item=2)[0]
        down = tnpu.npu_grouped_matmul([tnpu.npu_swiglu(gate_up, dim=-1)], [w2.transpose(1, 2)], group_list=counts,
                                       group_list_type=1, group_type=0, split_item=2)[0]
        return tnpu.npu_moe_token_unpermute(down, row_idx, probs=weights)

    # ----- expert parallel: MC2 (npu_moe_distribute_dispatch / _combine), as vllm-ascend's TokenDispatcherWithMC2 -----
    def _mc2(self, tokens: int, top_k: int, hidden: int, dtype: torch.dtype, num_experts: int, ep_size: int) -> bool:
        if self._soc_version is None:
            self._soc_version = self.torch_npu.npu.get_soc_version()
        return mc2_fits(self._soc_version, tokens, top_k, hidden, dtype, num_experts, ep_size)

    def _mc2_args(self, num_experts: int, ep_size: int) -> dict:
        """What dispatch and combine both take: the MC2 group's communicator, no shared-expert ranks, global_bs 0
        (every rank sends the same Tl tokens: sequence_parallel_chunk). On A3 the explicit no-TP arguments
        vllm-ascend passes there; A2 has no TP domain (defaults)."""
        group = ps.get_group(ps.MC2_GROUP)
        if group not in self._comm_names:
            self._comm_names[group] = hccl_comm_name(group)
        name = self._comm_names[group]
        args = dict(group_ep=name, ep_world_size=ep_size, ep_rank_id=dist.get_rank(group), moe_expert_num=num_experts,
                    expert_shard_type=0, shared_expert_rank_num=0, global_bs=0)
        if self._soc_version in A3_SOCS:
            args.update(group_tp=name, tp_world_size=1, tp_rank_id=0)
        return args

    def _mc2_sizes(self, tokens: int, top_k: int, num_experts: int, ep_size: int) -> tuple[int, int, int, int]:
        """Lengths of expand_idx, ep_recv_counts, tp_recv_counts, expand_scales (= expand_x's rows) for these args,
        as torch_npu allocates them (op-plugin's npu_moe_distribute_dispatch, without expert_scales)."""
        rows = ep_size * tokens * min(num_experts // ep_size, top_k)
        return tokens * top_k, num_experts, int(self._soc_version in A3_SOCS), rows

    def ep_dispatch(self, hidden: Tensor, topk_ids: Tensor, num_experts: int, ep_size: int,
                    group_name: str) -> tuple[Tensor, Tensor, Tensor]:
        tokens, top_k = topk_ids.shape
        if not self._mc2(tokens, top_k, hidden.shape[1], hidden.dtype, num_experts, ep_size):
            return ep_dispatch.reference(hidden, topk_ids, num_experts, ep_size, group_name)
        args = self._mc2_args(num_experts, ep_size)
        expand_x, _, expand_idx, expert_token_nums, ep_recv_counts, tp_recv_counts, expand_scales = (
            self.torch_npu.npu_moe_distribute_dispatch(hidden, _mc2_expert_ids(topk_ids), quant_mode=0,
                                                       expert_token_nums_type=0, **args))
        sizes = self._mc2_sizes(tokens, top_k, num_experts, ep_size)
        if expand_scales is None:  # A3 documents None
            expand_scales = torch.zeros(sizes[3], dtype=torch.float32, device=hidden.device)
        got = (expand_idx.shape[0], ep_recv_counts.shape[0], tp_recv_counts.shape[0], expand_scales.shape[0])
        if got != sizes or expand_x.shape[0] != sizes[3]:
            raise RuntimeError(f"npu_moe_distribute_dispatch returned expand_x {tuple(expand_x.shape)} and "
                               f"(expand_idx, ep_recv_counts, tp_recv_counts, expand_scales) of lengths {got}; "
                               f"graphinfer expects {sizes[3]} rows and {sizes}. Use kernels='reference' for expert "
                               f"parallel with this torch_npu.")
        # expand_x: the received rows grouped by local expert, expert_token_nums the cumulative counts (type 0); rows
        # past the last count are undefined. Row i's local expert = the number of group ends at or before i.
        n = ep_size * tokens * top_k  # ep_dispatch's rows (MC2 gives ep * Tl * min(local, K) of them)
        local_ids = (torch.arange(n, device=hidden.device).unsqueeze(1) >= expert_token_nums).sum(dim=1)
        valid = local_ids < num_experts // ep_size
        rows = torch.where(valid.unsqueeze(1), F.pad(expand_x, (0, 0, 0, n - sizes[3])),
                           torch.zeros((), dtype=expand_x.dtype, device=expand_x.device))
        # combine_metadata: the four tensors combine takes back, one int32 buffer of the size every impl returns
        meta = torch.cat((expand_idx, ep_recv_counts, tp_recv_counts, expand_scales.view(torch.int32)))
        meta = F.pad(meta, (0, combine_metadata_size(tokens, top_k, num_experts, ep_size) - meta.shape[0]))
        return rows, torch.where(valid, local_ids, -1), meta

    def ep_combine(self, expert_rows: Tensor, topk_ids: Tensor, topk_weights: Tensor, combine_metadata: Tensor,
                   num_experts: int, ep_size: int, group_name: str) -> Tensor:
        tokens, top_k = topk_weights.shape
        if not self._mc2(tokens, top_k, expert_rows.shape[1], expert_rows.dtype, num_experts, ep_size):
            return ep_combine.reference(expert_rows, topk_ids, topk_weights, combine_metadata, num_experts, ep_size,
                                        group_name)
        sizes = self._mc2_sizes(tokens, top_k, num_experts, ep_size)
        expand_idx, ep_recv_counts, tp_recv_counts, expand_scales = combine_metadata[:sum(sizes)].split(sizes)
        args = self._mc2_args(num_experts, ep_size)
        if self._soc_version in A3_SOCS:
            args["tp_send_counts"] = tp_recv_counts
        else:  # A2 requires dispatch's expand_scales back; A3 takes none
            args["expand_scales"] = expand_scales.view(torch.float32)
        # expert_rows past expand_x's rows are ep_dispatch's zero padding; combine weighs by topk_weights itself.
        return self.torch_npu.npu_moe_distribute_combine(expert_rows[:sizes[3]], _mc2_expert_ids(topk_ids), expand_idx,
                                                         ep_recv_counts, topk_weights.float(), **args)


@dataclass
class _FiaTask:
    handle: object  # from graph_task_group_end
    event: object  # the ExternalEvent the captured task waits on
    kwargs: dict  # the captured call minus the lengths (same tensors: the update must re-issue on them)
    q_cum: list[int]


class FiaGraphParams:
    """FIA inside ACL graphs (vllm-ascend's GraphParams + full_graph_fia / update_graph_params).

    FIA's lengths are host lists feeding host-side tiling, baked into a captured task. So each FIA call of a
    FULL_DECODE_ONLY graph is captured as a task group behind an ExternalEvent, with a workspace precomputed
    per bucket; before each replay, `update(graph, seq_lens)` re-issues every task of that graph on a side
    stream with the step's lengths (graph_task_update_begin/end) and records the event that releases it.
    Queries and outputs go through buffers shared by all layers and graphs, so the captured tasks keep no
    per-graph activations alive in the graph pool.
    """

    def __init__(self, ops: NpuOps):
        self.ops = ops
        self.tasks: dict[object, list[_FiaTask]] = {}  # graph -> its FIA tasks in capture order
        self.workspaces: dict[int, Tensor] = {}  # num_tokens -> workspace (shared by the layers of a bucket)
        self._buffers: dict[tuple, Tensor] = {}
        self._current: list[_FiaTask] | None = None
        self._update_stream = None

    @property
    def is_capturing(self) -> bool:
        return self._current is not None

    @contextmanager
    def capturing(self, graph):
        """While `graph` is being captured, FIA calls are recorded as its tasks."""
        self._current = self.tasks.setdefault(graph, [])
        try:
            yield
        finally:
            self._current = None

    def _buffer(self, name: str, like: Tensor) -> Tensor:
        key = (name, like.dtype, like.device, tuple(like.shape[1:]))
        buf = self._buffers.get(key)
        if buf is None or buf.shape[0] < like.shape[0]:  # a larger bucket: a new buffer (earlier tasks keep theirs)
            buf = self._buffers[key] = torch.empty_like(like)
        return buf[:like.shape[0]]

    def capture(self, query: Tensor, kwargs: dict, num_reqs: int) -> Tensor:
        tnpu = self.ops.torch_npu
        npu = tnpu.npu
        num_tokens = query.shape[0]
        if num_tokens != num_reqs:
            raise RuntimeError(f"FIA capture expects a uniform decode batch (one query row per request), got "
                               f"{num_tokens} rows for {num_reqs} requests.")
        q = self._buffer("query", query)
        q.copy_(query)
        out = self._buffer("out", query)
        lse = self._buffer("lse", query.new_empty(1))  # softmax_lse_flag=False: a [1] placeholder
        q_cum = list(range(1, num_tokens + 1))
        lengths = dict(actual_seq_lengths=q_cum, actual_seq_lengths_kv=[1] * num_tokens)  # patched before each replay
        workspace = self.workspaces.get(num_tokens)
        if workspace is None:
            workspace = self.workspaces[num_tokens] = tnpu._npu_fused_infer_attention_score_get_max_workspace(
                q, **kwargs, **lengths)
        stream = npu.current_stream()
        event = npu.ExternalEvent()
        event.wait(stream)  # captured: at replay the task waits until update() has patched it
        event.reset(stream)
        npu.graph_task_group_begin(stream)
        call = dict(query=q, **kwargs, workspace=workspace, out=[out, lse])
        tnpu.npu_fused_infer_attention_score.out(**call, **lengths)
        self._current.append(_FiaTask(npu.graph_task_group_end(stream), event, call, q_cum))
        return out

    def update(self, graph, seq_lens: np.ndarray) -> None:
        """Patch the KV lengths of `graph`'s FIA tasks to this step's (padded rows: 0 -> 1, their rows are zeroed)."""
        tasks = self.tasks.get(graph)
        if not tasks:
            return
        npu = self.ops.torch_npu.npu
        kv_lens = [max(int(n), 1) for n in seq_lens]
        if self._update_stream is None:
            self._update_stream = npu.Stream()
        stream = self._update_stream
        npu.current_stream().synchronize()  # the previous replay must be done before its tasks are rewritten
        with npu.stream(stream):
            for task in tasks:
                if len(kv_lens) != len(task.q_cum):
                    raise ValueError(f"graph captured for {len(task.q_cum)} requests, got {len(kv_lens)} lengths")
                npu.graph_task_update_begin(stream, task.handle)
                self.ops.torch_npu.npu_fused_infer_attention_score.out(
                    **task.kwargs, actual_seq_lengths=task.q_cum, actual_seq_lengths_kv=kv_lens)
                npu.graph_task_update_end(stream)
                task.event.record(stream)
