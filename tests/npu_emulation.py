"""EMULATION — not torch_npu. A plain-PyTorch (CPU) stand-in for the torch_npu APIs graphinfer calls.

`make_torch_npu()` returns a fresh module-like object; tests hand it to graphinfer wherever a `torch_npu`
module is taken (NpuOps, NpuPlatform), so the Ascend adapters and the ACL-graph FIA update protocol run
without an NPU. Each op follows its documented semantics (layouts, cumulative vs per-request lengths,
in-place writes, return tuples) and checks the documented preconditions graphinfer relies on, so an adapter
that passes a device tensor where a host list is needed, per-request query lengths in TND, slot -1, or an
unsupported mode fails here. What the docs leave open is refused rather than guessed (a KV length of 0,
duplicate slots with different data). Not enforced: dtype limits of the hardware (FIA and the KV scatter
take fp16/bf16 on Atlas A2/A3), so the tests can compare with the reference ops in fp32.

Graphs: `npu.NPUGraph` tapes the aten ops issued while capturing and replays them on the same tensors (what
a device graph does with kernels); an FIA `.out` call inside a task group is taped as a patchable task, and
replay refuses to run a task whose ExternalEvent nobody recorded (on hardware that replay would hang).
Ops must be issued sync-free while capturing (their values are read at replay, not at capture).

Sources ([OP] = Ascend/op-plugin docs/context/torch_npu-<name>.md; [REF] = shared/reference/ascend.md;
[VA] = vllm-project/vllm-ascend, the production user whose calls graphinfer mirrors) are cited per op.
"""
import contextlib
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils._pytree
from torch.utils._python_dispatch import TorchDispatchMode

MASK_SIZE = 2048
_TRIU = torch.triu(torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool), diagonal=1)


@contextlib.contextmanager
def _untaped(state):
    """The emulation's own checks are not kernels: keep them off a graph being captured."""
    state.no_tape += 1
    try:
        yield
    finally:
        state.no_tape -= 1


class _State:
    def __init__(self):
        self.capturing = None  # the NPUGraph being captured
        self.streams = []  # the stack `npu.stream(s)` / capture push
        self.default_stream = None
        self.group = None  # the task group open during capture
        self.updating = None  # the task group being updated
        self.workspaces = set()  # data_ptrs handed out by _npu_fused_infer_attention_score_get_max_workspace
        self.no_tape = 0  # > 0 while the emulation checks arguments: those aten ops are not taped
        self.calls = []  # names of the torch_npu ops called, for the tests
        self.soc_version = 223  # npu.get_soc_version(): an Atlas A2 (220-225; A3: 250-255)
        self.comm_groups = {}  # HCCL communicator name -> the (gloo) process group standing in for it
        self.mc2_dispatched = {}  # group_ep -> the last MC2 dispatch's (expert_ids, outputs), for its combine


# ----------------------------------------------------------------------------------------------------------
# torch_npu.npu: streams, events, ACL graphs
# Sources: [OP] torch_npu-npu-graph_task_group_begin/_end, -graph_task_update_begin/_end (their example: event
# wait+reset captured before the group, update on a side stream then event.record, then replay),
# torch_npu-npu-ExternalEvent*; [REF] sections 1.2 and 3 (NPUGraph, graph(g, pool, stream), graph_pool_handle,
# is_current_stream_capturing); [VA] attention_v1.py full_graph_fia / update_graph_params.

class _Stream:
    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass


class _TaskGroup:
    """A captured task group: one FIA `.out` call whose host arguments graph_task_update_* may patch."""

    def __init__(self):
        self.kwargs = None


class _Tape(TorchDispatchMode):
    """Records the aten ops issued while capturing (as tests/test_capture.py's OpTapeGraph does)."""

    def __init__(self, graph, state):
        super().__init__()
        self.graph, self.state = graph, state

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.state.no_tape:
            return out
        schema = func._schema
        mutates = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        fresh = not _is_view(out, args, kwargs)
        if mutates or fresh:  # an op that writes an input and returns a new tensor (qk_norm_rope_cache) needs both
            self.graph.tape.append(("aten", func, args, kwargs, out if fresh else None))
        return out


def _is_view(out, args, kwargs) -> bool:
    """Whether `out` shares storage with an input: views need no replay (they see their base's new data).
    Decided on the tensors, not the schema: under inference_mode composites such as aten.to / contiguous are
    dispatched with may-alias schemas even when they copy."""
    inputs = {t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves((args, kwargs))
              if isinstance(t, torch.Tensor)}
    outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return bool(outs) and all(t.untyped_storage().data_ptr() in inputs for t in outs)


class _NpuNamespace:
    def __init__(self, state: "_State", fia):
        st = self._state = state
        st.default_stream = _Stream()
        self._fia = fia
        self.Stream = _Stream

        class ExternalEvent:  # [OP] torch_npu-npu-ExternalEvent: wait/reset are captured into the graph
            def __init__(self):
                self.recorded = False

            def wait(self, stream):
                if st.capturing is not None:
                    st.capturing.tape.append(("wait", self))

            def reset(self, stream):
                if st.capturing is not None:
                    st.capturing.tape.append(("reset", self))
                else:
                    self.recorded = False

            def record(self, stream):
                if st.capturing is not None:
                    raise RuntimeError("emulation: ExternalEvent.record is issued by the update stream, not captured")
                self.recorded = True

        class NPUGraph:
            def __init__(self):
                self.tape = []
                self.replays = 0

            def replay(self):
                if st.capturing is not None:
                    raise RuntimeError("emulation: replay during capture")
                for entry in self.tape:
                    kind = entry[0]
                    if kind == "aten":
                        _, func, args, kwargs, out = entry
                        result = func(*args, **kwargs)
                        if out is not None:
                            outs = out if isinstance(out, (tuple, list)) else [out]
                            res = result if isinstance(result, (tuple, list)) else [result]
                            for dst, src in zip(outs, res):
                                if isinstance(dst, torch.Tensor):
                                    dst.copy_(src)
                    elif kind == "wait" and not entry[1].recorded:
                        raise RuntimeError("emulation: replay would hang: a captured task waits on an ExternalEvent "
                                           "that was not recorded (graph_task_update_* not issued before replay)")
                    elif kind == "reset":
                        entry[1].recorded = False
                    elif kind == "fia":
                        fia._run_task(entry[1])
                self.replays += 1

        self.ExternalEvent, self.NPUGraph = ExternalEvent, NPUGraph

    def current_stream(self):
        st = self._state
        return st.streams[-1] if st.streams else st.default_stream

    @contextlib.contextmanager
    def stream(self, s):
        self._state.streams.append(s)
        try:
            yield
        finally:
            self._state.streams.pop()

    @contextlib.contextmanager
    def graph(self, graph, pool=None, stream=None, capture_error_mode="global"):
        st = self._state
        if st.capturing is not None:
            raise RuntimeError("emulation: nested capture")
        st.capturing = graph
        st.streams.append(stream or _Stream())
        try:
            with _Tape(graph, st):
                yield
            if st.group is not None:
                raise RuntimeError("emulation: graph_task_group_begin without graph_task_group_end")
        finally:
            st.streams.pop()
            st.capturing = None

    def is_current_stream_capturing(self):
        return self._state.capturing is not None

    def graph_pool_handle(self):
        return object()

    def graph_task_group_begin(self, stream):
        st = self._state
        if st.capturing is None or stream is not self.current_stream() or st.group is not None:
            raise RuntimeError("emulation: graph_task_group_begin needs the capturing stream, outside another group")
        st.group = _TaskGroup()

    def graph_task_group_end(self, stream):
        st = self._state
        group, st.group = st.group, None
        if group is None or group.kwargs is None or stream is not self.current_stream():
            raise RuntimeError("emulation: graph_task_group_end without a begun group holding one FIA call")
        return group  # the handle graph_task_update_begin takes

    def graph_task_update_begin(self, stream, handle):
        st = self._state
        if st.capturing is not None or stream is not self.current_stream() or not isinstance(handle, _TaskGroup):
            raise RuntimeError("emulation: graph_task_update_begin(stream, handle) runs on the update stream "
                               "(inside npu.stream(stream)) with a handle from graph_task_group_end")
        st.updating = handle
        handle.updated = False

    def graph_task_update_end(self, stream):
        st = self._state
        if st.updating is None or not st.updating.updated:
            raise RuntimeError("emulation: graph_task_update_end without an FIA call since update_begin")
        st.updating = None

    # device bookkeeping
    def synchronize(self, device=None):
        pass

    def mem_get_info(self, device=None):
        return 8 << 30, 16 << 30

    def memory_allocated(self, device=None):
        return 0

    def set_compile_mode(self, jit_compile=False):
        pass

    def get_soc_version(self):
        return self._state.soc_version


# ----------------------------------------------------------------------------------------------------------
# npu_fused_infer_attention_score (FIA)
# Sources: [OP] torch_npu-npu_fused_infer_attention_score: TND takes actual_seq_lengths as a cumulative host
# int list (SymInt[]) whose length is the batch, non-decreasing; page attention needs block_table (int32,
# [B, >= max blocks]) and actual_seq_lengths_kv, KV viewed (blocknum, blocksize, H = KV_N * D); num_heads a
# multiple of num_key_value_heads (ratio <= 64); sparse_mode 3 = right-down causal with the 2048x2048
# lower-triangular-kept mask (1 = masked); returns (attention_out like query, softmax_lse [1] when
# softmax_lse_flag=False); `.out` takes workspace= and out=[attention_out, softmax_lse].
# [VA] attention_v1.py: TND + block_table, actual_seq_lengths = query_start_loc[1:] (cumulative, last = rows of
# query), actual_seq_lengths_kv = per-request seq_lens (paged KV), sparse_mode=3,
# mask triu(ones(2048, 2048), 1).to(int8). [REF] section 4: TND block_size a multiple of 16, <= 1024; B <= 4096.
# Not documented (refused here): a KV length of 0.

def _check_fia(query, key, value, *, atten_mask=None, actual_seq_lengths=None, actual_seq_lengths_kv=None,
               block_table=None, num_heads=1, scale=1.0, pre_tokens=2147483647, next_tokens=2147483647,
               input_layout="BSH", num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
               softmax_lse_flag=False, **unsupported):
    if unsupported:
        raise NotImplementedError(f"emulation covers no FIA argument {sorted(unsupported)}")
    if input_layout != "TND" or block_table is None:
        raise NotImplementedError("emulation covers FIA with input_layout='TND' and paged KV (block_table) only")
    for name, lens in (("actual_seq_lengths", actual_seq_lengths), ("actual_seq_lengths_kv", actual_seq_lengths_kv)):
        if not isinstance(lens, (list, tuple)) or not all(isinstance(n, int) for n in lens):
            raise TypeError(f"{name} must be a host list of ints (SymInt[]), got {type(lens).__name__}")
    if query.dim() != 3 or not query.is_contiguous() or query.shape[1] != num_heads:
        raise ValueError(f"TND query must be contiguous [T, num_heads={num_heads}, D], got {tuple(query.shape)}")
    kv_heads = num_key_value_heads or num_heads
    if num_heads % kv_heads or num_heads // kv_heads > 64:
        raise ValueError(f"num_heads={num_heads} must be a multiple (<= 64x) of num_key_value_heads={kv_heads}")
    T, _, D = query.shape
    if key.shape != value.shape or key.dim() != 3 or key.shape[2] != kv_heads * D or key.shape[1] != block_size:
        raise ValueError(f"paged KV must be (num_blocks, block_size={block_size}, KV_N*D={kv_heads * D}), "
                         f"got {tuple(key.shape)}")
    if not (key.is_contiguous() and value.is_contiguous()):
        raise ValueError("key/value must be contiguous")
    if block_size % 16 or not 0 < block_size <= 1024:
        raise ValueError(f"TND page attention: block_size={block_size} must be a multiple of 16, <= 1024")
    B = len(actual_seq_lengths)
    if B > 4096 or len(actual_seq_lengths_kv) != B:
        raise ValueError("TND: batch = len(actual_seq_lengths) <= 4096, and actual_seq_lengths_kv has one entry each")
    prev = 0
    for n in actual_seq_lengths:
        if n < prev:
            raise ValueError(f"TND actual_seq_lengths must be cumulative (non-decreasing): {actual_seq_lengths}")
        prev = n
    if actual_seq_lengths[-1] != T:
        raise ValueError(f"TND: the last cumulative query length ({actual_seq_lengths[-1]}) must equal T={T}")
    if block_table.dtype != torch.int32 or block_table.dim() != 2 or block_table.shape[0] != B:
        raise ValueError(f"block_table must be int32 [B={B}, max_blocks], got {block_table.dtype} "
                         f"{tuple(block_table.shape)}")
    q_lens = [e - s for s, e in zip([0, *actual_seq_lengths[:-1]], actual_seq_lengths)]
    for q, kv in zip(q_lens, actual_seq_lengths_kv):
        if kv <= 0:
            raise ValueError("emulation: a KV length of 0 has no documented FIA behaviour")
        if kv > block_table.shape[1] * block_size:
            raise ValueError(f"KV length {kv} exceeds the block table ({block_table.shape[1]} blocks)")
        if sparse_mode == 3 and q > kv:
            raise ValueError(f"sparse_mode=3 (right-down causal) needs query length {q} <= KV length {kv}")
    if sparse_mode == 3:
        m = atten_mask
        if m is None or m.shape[-2:] != (MASK_SIZE, MASK_SIZE) or m.dtype not in (torch.bool, torch.int8, torch.uint8):
            raise ValueError("sparse_mode=3 needs the compressed 2048x2048 bool/int8 mask")
        if not torch.equal(m.reshape(MASK_SIZE, MASK_SIZE).cpu().bool(), _TRIU):
            raise ValueError("sparse_mode=3 mask must be triu(ones(2048, 2048), diagonal=1) (1 = masked)")
    elif sparse_mode != 0 or atten_mask is not None:
        raise ValueError("TND supports sparse_mode=0 without a mask or sparse_mode=3 with one")
    return q_lens


def _fia_compute(query, key, value, **kw):
    q_lens = _check_fia(query, key, value, **kw)
    bt, bs, scale = kw["block_table"], kw["block_size"], kw.get("scale", 1.0)
    N = query.shape[1]
    kv_heads = kw.get("num_key_value_heads") or N
    D = query.shape[2]
    k_all = key.reshape(-1, kv_heads, D)
    v_all = value.reshape(-1, kv_heads, D)
    out = torch.empty_like(query)
    start = 0
    for b, (n, L) in enumerate(zip(q_lens, kw["actual_seq_lengths_kv"])):
        if n:
            pos = torch.arange(L)
            slots = bt[b, pos // bs].long() * bs + pos % bs
            k = k_all[slots].float().repeat_interleave(N // kv_heads, 1).transpose(0, 1)  # [N, L, D]
            v = v_all[slots].float().repeat_interleave(N // kv_heads, 1).transpose(0, 1)
            q = query[start:start + n].float().transpose(0, 1)  # [N, n, D]
            scores = q @ k.transpose(1, 2) * scale
            if kw.get("sparse_mode") == 3:  # right-down causal: query row j sees KV 0 .. L - n + j
                allowed = torch.arange(L)[None, :] <= (L - n + torch.arange(n))[:, None]
                scores = scores.masked_fill(~allowed, float("-inf"))
            out[start:start + n] = (torch.softmax(scores, -1) @ v).transpose(0, 1).to(query.dtype)
        start += n
    return out, torch.zeros(1, dtype=torch.float32)


class _Fia:
    def __init__(self, state):
        self.state = state

    def __call__(self, query, key, value, **kw):
        self.state.calls.append("npu_fused_infer_attention_score")
        if self.state.capturing is not None:
            raise RuntimeError("emulation: functional FIA issued while capturing (its host lengths would be baked)")
        return _fia_compute(query, key, value, **kw)

    def out(self, query, key, value, *, workspace=None, out=None, **kw):
        st = self.state
        st.calls.append("npu_fused_infer_attention_score.out")
        if workspace is None or workspace.data_ptr() not in st.workspaces or not isinstance(out, list) or len(out) != 2:
            raise ValueError(".out needs workspace= from _npu_fused_infer_attention_score_get_max_workspace and "
                             "out=[attention_out, softmax_lse]")
        call = dict(query=query, key=key, value=value, workspace=workspace, out=out, **kw)
        if st.group is not None:  # captured: nothing runs now; replay runs it with the then-current arguments
            with _untaped(st):
                _check_fia(query, key, value, **kw)
            st.group.kwargs = call
            st.capturing.tape.append(("fia", st.group))
        elif st.updating is not None:
            captured = st.updating.kwargs
            for name in ("query", "key", "value", "workspace", "atten_mask"):
                if call[name].data_ptr() != captured[name].data_ptr():
                    raise ValueError(f"update must re-issue the captured task on the same tensors ({name} moved)")
            if [t.data_ptr() for t in out] != [t.data_ptr() for t in captured["out"]]:
                raise ValueError("update must write the captured outputs")
            fixed = ("num_heads", "scale", "input_layout", "num_key_value_heads", "sparse_mode", "block_size")
            if any(kw.get(k) != captured.get(k) for k in fixed):
                raise ValueError("update may change lengths and block_table only")
            _check_fia(query, key, value, **kw)
            st.updating.kwargs = call
            st.updating.updated = True
        else:
            o, lse = _fia_compute(query, key, value, **kw)
            out[0].copy_(o)

    def _run_task(self, group):
        kw = dict(group.kwargs)
        out = kw.pop("out")
        kw.pop("workspace")
        o, _ = _fia_compute(kw.pop("query"), kw.pop("key"), kw.pop("value"), **kw)
        out[0].copy_(o)


# ----------------------------------------------------------------------------------------------------------

def make_torch_npu(soc_version: int = 223):
    st = _State()
    st.soc_version = soc_version
    fia = _Fia(st)
    m = types.ModuleType("torch_npu")
    m.__doc__ = "EMULATION of torch_npu (tests/npu_emulation.py), not the real package."
    m.emulation_state = st
    m.npu = _NpuNamespace(st, fia)
    m.npu_fused_infer_attention_score = fia

    def traced(name):
        def deco(fn):
            def wrapper(*args, **kwargs):
                st.calls.append(name)
                return fn(*args, **kwargs)  # composites of aten ops: taped while capturing like kernels
            wrapper.__name__ = name
            setattr(m, name, wrapper)
            return wrapper
        return deco

    # [OP] torch_npu-npu_fused_infer_attention_score / [VA] full_graph_fia: the max workspace for these shapes;
    # the same argument checks as the op (tiling runs on them).
    @traced("_npu_fused_infer_attention_score_get_max_workspace")
    def _(query, key, value, **kw):
        with _untaped(st):
            _check_fia(query, key, value, **kw)
            ws = torch.empty(64, dtype=torch.uint8)
        st.workspaces.add(ws.data_ptr())
        return ws

    # [REF] section 4: npu_rms_norm(self, gamma, epsilon=1e-6) -> (y, rstd), rstd fp32 over the last dim.
    # Computed in fp32 with one final cast (the kernel's internal precision is not documented; fp32 tests only).
    @traced("npu_rms_norm")
    def _(x, gamma, epsilon=1e-6):
        h = x.float()
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + epsilon)
        return (h * rstd * gamma.float()).to(x.dtype), rstd

    # [REF] section 4: npu_add_rms_norm(x1, x2, gamma, epsilon) -> (y, rstd, x) with x = x1 + x2 (the new residual).
    @traced("npu_add_rms_norm")
    def _(x1, x2, gamma, epsilon=1e-6):
        x = x1 + x2
        y, rstd = m.npu_rms_norm(x, gamma, epsilon)
        return y, rstd, x

    # [OP] torch_npu-npu_rotary_mul: 4-D input, r1/r2 4-D broadcast (BSND input: 1S1D, BS1D, BSND); D even, < 896.
    # 'half': cat(-x2, x1) of the two halves; 'interleave': stack(-x_odd, x_even) pairs. output = r1*x + r2*x_new.
    @traced("npu_rotary_mul")
    def _(x, r1, r2, rotary_mode="half"):
        if x.dim() != 4 or r1.dim() != 4 or r1.shape != r2.shape or x.shape[-1] % 2 or x.shape[-1] >= 896:
            raise ValueError(f"npu_rotary_mul: 4-D input with even D < 896 and 4-D r1/r2 of one shape, got "
                             f"{tuple(x.shape)}, {tuple(r1.shape)}")
        torch.broadcast_shapes(r1.shape, x.shape)
        if rotary_mode == "half":
            x1, x2 = x.chunk(2, -1)
            rotated = torch.cat((-x2, x1), -1)
        elif rotary_mode == "interleave":
            rotated = torch.stack((-x[..., 1::2], x[..., ::2]), -1).flatten(-2)
        else:
            raise ValueError(f"rotary_mode={rotary_mode!r}: 'half' or 'interleave'")
        return r1 * x + r2 * rotated

    # [REF] section 4: npu_swiglu(self, dim=-1) = silu(A) * B, A the FIRST half along dim.
    @traced("npu_swiglu")
    def _(x, dim=-1):
        a, b = x.chunk(2, dim)
        return F.silu(a) * b

    # [OP] torch_npu-npu_scatter_pa_kv_cache (+ aclnnScatterPaKvCache scenario 2, cache_mode "Norm"): key/value
    # [T, N, D], caches [num_blocks, block_size, N, D], slot_mapping int32/int64 [T]; inputs contiguous, one dtype;
    # caches updated in place, returns nothing. Slots must lie in [0, num_blocks * block_size - 1] and be unique
    # ("duplicates: correctness not guaranteed"): emulated as an error unless duplicates carry identical data.
    @traced("npu_scatter_pa_kv_cache")
    def _(key, value, key_cache, value_cache, slot_mapping, *, compress_lens=None, compress_seq_offsets=None,
          seq_lens=None, cache_mode="PA_NZ"):
        if cache_mode != "Norm" or key.dim() != 3 or key_cache.dim() != 4 or key_cache.shape[2:] != key.shape[1:]:
            raise NotImplementedError("emulation covers cache_mode='Norm' with key [T, N, D] and cache "
                                      "[num_blocks, block_size, N, D] only")
        tensors = (key, value, key_cache, value_cache, slot_mapping)
        if not all(t.is_contiguous() for t in tensors) or len({key.dtype, value.dtype, key_cache.dtype,
                                                              value_cache.dtype}) != 1:
            raise ValueError("npu_scatter_pa_kv_cache: contiguous inputs of one dtype")
        if slot_mapping.dtype not in (torch.int32, torch.int64) or slot_mapping.shape != key.shape[:1]:
            raise ValueError("slot_mapping: int32/int64 [T]")
        slots = slot_mapping.long()
        if st.capturing is None:  # value checks read the data: only outside capture (replay re-runs the writes)
            n = key_cache.shape[0] * key_cache.shape[1]
            if bool(((slots < 0) | (slots >= n)).any()):
                raise ValueError(f"slot_mapping values must be in [0, {n - 1}] (no documented skip of -1)")
            for cache_src in (key, value):
                order = torch.argsort(slots, stable=True)
                s, rows = slots[order], cache_src[order].flatten(1)
                same = s[1:] == s[:-1]
                if bool(same.any()) and not torch.equal(rows[1:][same], rows[:-1][same]):
                    raise ValueError("duplicate slots with different data: result undefined")
        key_cache.view(-1, *key.shape[1:]).index_copy_(0, slots, key)
        value_cache.view(-1, *value.shape[1:]).index_copy_(0, slots, value)

    # [REF] section 4 / [OP] torch_npu-npu_scatter_nd_update_: in place, self[indices[i]] = updates[i]; here the form
    # the MLA cache write uses: self [N, D], indices int32/int64 [T, 1] (rows of self), updates [T, D] of self's dtype.
    # Indices must be in range (no documented skip of -1); duplicates with different data refused (order undefined).
    @traced("npu_scatter_nd_update_")
    def _(self_, indices, updates):
        if self_.dim() != 2 or indices.dim() != 2 or indices.shape[1] != 1 or updates.shape != (indices.shape[0],
                                                                                               self_.shape[1]):
            raise NotImplementedError("emulation covers self [N, D], indices [T, 1], updates [T, D] only")
        if indices.dtype not in (torch.int32, torch.int64) or updates.dtype != self_.dtype:
            raise ValueError("npu_scatter_nd_update_: int32/int64 indices, updates of self's dtype")
        if not (self_.is_contiguous() and indices.is_contiguous() and updates.is_contiguous()):
            raise ValueError("npu_scatter_nd_update_: contiguous tensors")
        rows = indices[:, 0].long()
        if st.capturing is None:  # value checks read the data: only outside capture
            if bool(((rows < 0) | (rows >= self_.shape[0])).any()):
                raise ValueError(f"indices must be in [0, {self_.shape[0] - 1}] (no documented skip of -1)")
            order = torch.argsort(rows, stable=True)
            r, u = rows[order], updates[order]
            same = r[1:] == r[:-1]
            if bool(same.any()) and not torch.equal(u[1:][same], u[:-1][same]):
                raise ValueError("duplicate indices with different data: result undefined")
        self_.index_copy_(0, rows, updates)
        return self_

    # [OP] torch_npu-npu_moe_gating_top_k_softmax: softmaxOut = softmax(x, -1); y, expert_idx = topK(softmaxOut, k);
    # row_idx = arange(N*k).reshape(k, N).T; y in x's dtype, expert_idx/row_idx int32; 0 < k <= min(E, 1024).
    @traced("npu_moe_gating_top_k_softmax")
    def _(x, finished=None, k=1):
        if finished is not None or x.dim() != 2 or not 0 < k <= min(x.shape[-1], 1024):
            raise NotImplementedError("emulation covers 2-D x, finished=None, 0 < k <= min(E, 1024)")
        y, idx = torch.topk(torch.softmax(x, -1), k, dim=-1)
        n = x.shape[0]
        row_idx = torch.arange(n * k, dtype=torch.int32).reshape(k, n).t().contiguous()
        return y, idx.to(torch.int32), row_idx

    # [OP] torch_npu-npu_moe_init_routing_v2: x [NUM_ROWS, H], expert_idx int32 [NUM_ROWS, K]; active_num must be
    # NUM_ROWS*K; dropless (drop_pad_mode 0); expert_tokens_num_type 1 = per-expert counts over active_expert_range
    # (int64 [end - start]); quant_mode -1 = none. Sort the flattened (token-major, slot t*K+k) expert ids:
    # expanded_x[i] = x[sorted_row[i] // K]; row_idx_type 0: expanded_row_idx[sorted_row[i]] = i (indexed by
    # source slot, what npu_moe_token_unpermute takes: [VA] TokenDispatcherWithAllGather passes it straight on);
    # row_idx_type 1: expanded_row_idx = sorted_row. Stable sort here (the kernel's tie order is not documented;
    # the pair with unpermute does not depend on it).
    @traced("npu_moe_init_routing_v2")
    def _(x, expert_idx, *, scale=None, offset=None, active_num=-1, expert_capacity=-1, expert_num=-1,
          drop_pad_mode=0, expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=0,
          active_expert_range=(), row_idx_type=0):
        rows, K = expert_idx.shape
        if (x.dim() != 2 or expert_idx.dtype != torch.int32 or active_num != rows * K or drop_pad_mode != 0
                or expert_tokens_num_type != 1 or not expert_tokens_num_flag or quant_mode != -1 or scale is not None
                or offset is not None or row_idx_type not in (0, 1)):
            raise NotImplementedError("emulation covers the unquantised dropless count mode vllm-ascend uses")
        start, end = active_expert_range
        if not 0 <= start < end <= expert_num:
            raise ValueError(f"active_expert_range {active_expert_range} must lie in [0, expert_num={expert_num}]")
        flat = expert_idx.reshape(-1).long()
        sorted_row = torch.argsort(flat, stable=True)
        inverse = torch.empty_like(sorted_row)
        inverse[sorted_row] = torch.arange(rows * K)
        counts = torch.zeros(expert_num, dtype=torch.int64).scatter_add_(0, flat, torch.ones_like(flat))[start:end]
        row_idx = (inverse if row_idx_type == 0 else sorted_row).to(torch.int32)
        return x[sorted_row // K], row_idx, counts, torch.zeros(rows * K, dtype=torch.float32)

    # [OP] torch_npu-npu_grouped_matmul, group_type 0 (m axis), "single-single-single": x=[x (M, K)],
    # weight=[w (E, K, N)] (transposed weight allowed, x not), split_item 2/3 -> [y (M, N)]; group_list an int64
    # tensor with group_list_type 0 = cumsum (last == M) or 1 = per-group counts (sum == M, non-negative); group e
    # is y[rows of e] = x[rows of e] @ w[e]. Computed sync-free (every group over all rows, then selected).
    @traced("npu_grouped_matmul")
    def _(x, weight, *, group_list=None, group_list_type=0, group_type=None, split_item=0, bias=None, **rest):
        if (len(x) != 1 or len(weight) != 1 or group_type != 0 or split_item not in (2, 3) or bias is not None
                or any(v is not None for v in rest.values())):
            raise NotImplementedError("emulation covers single-tensor m-grouped form (group_type 0, split_item 2/3)")
        a, w = x[0], weight[0]
        if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[1] or a.stride(-1) != 1:
            raise ValueError(f"x (M, K) non-transposed, weight (E, K, N): got {tuple(a.shape)}, {tuple(w.shape)}")
        if (not isinstance(group_list, torch.Tensor) or group_list.dtype != torch.int64
                or group_list.shape != (w.shape[0],)):
            raise ValueError("group_list: int64 tensor with one entry per group")
        if group_list_type == 1:
            ends = torch.cumsum(group_list, 0)
        elif group_list_type == 0:
            ends = group_list
        else:
            raise NotImplementedError("group_list_type 2 is int8-only")
        if st.capturing is None and (int(ends[-1]) != a.shape[0] or bool((ends[1:] < ends[:-1]).any())
                                     or bool((group_list < 0).any())):
            raise ValueError(f"group_list (type {group_list_type}) must cover the {a.shape[0]} rows: "
                             f"{group_list.tolist()}")
        group_of_row = torch.searchsorted(ends, torch.arange(a.shape[0]), right=True)
        y = torch.zeros(a.shape[0], w.shape[2], dtype=a.dtype)
        for e in range(w.shape[0]):
            y = torch.where((group_of_row == e)[:, None], a @ w[e], y)
        return [y]

    # [OP]/[VA] npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
    # restore_shape=None) = aclnnMoeTokenUnpermute: out[t] = sum_k permuted[sorted_indices[t*K + k]] * probs[t, k];
    # sorted_indices int32 [T*K] without duplicates; tokens and probs of one dtype (MindSpeed-MM casts to match).
    @traced("npu_moe_token_unpermute")
    def _(permuted_tokens, sorted_indices, probs=None, padded_mode=False, restore_shape=None):
        if padded_mode or probs is None or sorted_indices.dtype != torch.int32 or probs.dtype != permuted_tokens.dtype:
            raise NotImplementedError("emulation covers padded_mode=False, probs of the tokens' dtype, int32 indices")
        T, K = probs.shape
        rows = permuted_tokens[sorted_indices.long()].view(T, K, -1)
        return (rows.float() * probs.float().unsqueeze(-1)).sum(1).to(permuted_tokens.dtype)


    # ----- MC2 expert parallel -----
    # [OP] torch_npu-npu_moe_distribute_dispatch / -npu_moe_distribute_combine (op-plugin docs/context; output
    # shapes from op-plugin's MoeDistributeDispatchKernelOpApi.cpp); [VA] TokenDispatcherWithMC2.
    # group_ep names an HCCL communicator (a stand-in: `emulation_comm_name(group)` registers a gloo group under a
    # name); every rank of it calls the op together. Covered: unquantised (quant_mode 0, no scales), no shared-expert
    # ranks, global_bs 0 or BS*ep (the same BS on every rank), no TP domain (A2: its defaults only; A3: tp_world_size
    # 0 or 1). Expert e lives on rank e // (E / ep).
    # Dispatch: expand_x [A, H], A = BS*ep*min(local_expert_num, K), holds the rows received, grouped by local
    # expert, with expert_token_nums their counts (type 1) or cumsum (type 0); the order inside a group is not
    # documented (here: source rank, then token); rows past the last count are not defined (NaN here). expand_idx
    # [BS*K], ep_recv_counts [ep*local] (cumulative) and tp_recv_counts [tp_world_size] are documented only as "pass
    # them to combine" (values differ by product and version); here expand_idx[t*K + k] = the slot's place among
    # this rank's tokens for that expert, ep_recv_counts = cumulative counts per (local expert, source rank).
    # expand_scales [A] float (A3: None). Combine goes the dispatch's path back: out[t] = sum_k expert_scales[t, k]
    # * (the row of expand_x, on the expert's rank, that slot (t, k) went to), in expand_x's dtype. It takes the
    # dispatch's expert_ids, expand_idx and ep_recv_counts (as ep_send_counts) with the same group and sizes; A2
    # requires the dispatch's expand_scales back, A3 takes none (tp_send_counts = tp_recv_counts instead).
    def emulation_comm_name(group):  # stands in for group._get_backend(npu).get_hccl_comm_name(rank)
        name = f"hccl_emulated_{id(group)}"
        st.comm_groups[name] = group
        return name

    m.emulation_comm_name = emulation_comm_name

    def mc2_group(group_ep, ep_world_size, ep_rank_id, moe_expert_num, group_tp, tp_world_size, tp_rank_id,
                  expert_shard_type, shared_expert_rank_num, global_bs, bs):
        group = st.comm_groups.get(group_ep)
        if group is None or dist.get_world_size(group) != ep_world_size or dist.get_rank(group) != ep_rank_id:
            raise ValueError(f"group_ep {group_ep!r}: an HCCL communicator name of ep_world_size ranks, ep_rank_id "
                             f"this rank's place in it")
        if moe_expert_num % ep_world_size or not 0 < moe_expert_num <= 512:
            raise ValueError("moe_expert_num in [1, 512], a multiple of ep_world_size - shared_expert_rank_num")
        if expert_shard_type != 0 or shared_expert_rank_num != 0:
            raise NotImplementedError("emulation covers MoE expert ranks only (no shared-expert ranks)")
        a2 = 220 <= st.soc_version <= 225
        if (a2 and (group_tp != "" or tp_world_size != 0 or tp_rank_id != 0)) or tp_world_size not in (0, 1):
            raise NotImplementedError("no TP domain: A2 takes the defaults, A3 tp_world_size 0 or 1 (no TP comm)")
        with _untaped(st):
            sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(ep_world_size)]
            dist.all_gather(sizes, torch.tensor([bs]), group=group)
        if global_bs not in (0, bs * ep_world_size) or len({int(n) for n in sizes}) != 1:
            raise NotImplementedError("emulation covers the same BS on every rank with global_bs 0 or BS * ep")
        return group, a2

    def gather(t, group):
        parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.stack(parts)

    @traced("npu_moe_distribute_dispatch")
    def _(x, expert_ids, group_ep, ep_world_size, ep_rank_id, moe_expert_num, *, scales=None, x_active_mask=None,
          expert_scales=None, group_tp="", tp_world_size=0, tp_rank_id=0, expert_shard_type=0, shared_expert_num=1,
          shared_expert_rank_num=0, quant_mode=0, global_bs=0, expert_token_nums_type=1):
        bs, k = expert_ids.shape
        if x.dim() != 2 or expert_ids.dtype != torch.int32 or x.shape[0] != bs or not 0 < k <= moe_expert_num:
            raise ValueError("x [BS, H], expert_ids int32 [BS, K], 0 < K <= moe_expert_num")
        if quant_mode != 0 or scales is not None or expert_scales is not None or x_active_mask is not None:
            raise NotImplementedError("emulation covers the unquantised form without expert_scales")
        if expert_token_nums_type not in (0, 1):
            raise ValueError("expert_token_nums_type: 0 (cumsum) or 1 (counts)")
        group, a2 = mc2_group(group_ep, ep_world_size, ep_rank_id, moe_expert_num, group_tp, tp_world_size,
                              tp_rank_id, expert_shard_type, shared_expert_rank_num, global_bs, bs)
        if st.capturing is None:
            ordered = expert_ids.sort(-1).values
            repeat = (ordered[:, 1:] == ordered[:, :-1]).any()
            if bool(((expert_ids < 0) | (expert_ids >= moe_expert_num)).any() or repeat):
                raise ValueError("expert_ids: values in [0, moe_expert_num), the K of a row distinct")
        ep, local, me = ep_world_size, moe_expert_num // ep_world_size, ep_rank_id
        xs, ids = gather(x, group), gather(expert_ids, group).long()  # [ep, BS, H], [ep, BS, K]
        src, tok, slot = (ids // local == me).nonzero(as_tuple=True)
        expert = ids[src, tok, slot] - me * local
        order = torch.argsort((expert * ep + src) * bs + tok)
        rows, expert, src = xs[src, tok][order], expert[order], src[order]
        a = bs * ep * min(local, k)
        expand_x = torch.full((a * max(tp_world_size, 1), x.shape[1]), float("nan"), dtype=x.dtype)
        expand_x[:rows.shape[0]] = rows
        counts = torch.bincount(expert, minlength=local)
        expert_token_nums = counts.cumsum(0) if expert_token_nums_type == 0 else counts
        ep_recv_counts = torch.bincount(expert * ep + src, minlength=local * ep).cumsum(0).to(torch.int32)
        mine = F.one_hot(expert_ids.long(), moe_expert_num).sum(1)  # [BS, E]: which experts each token goes to
        expand_idx = (mine.cumsum(0) - mine).gather(1, expert_ids.long()).reshape(-1).to(torch.int32)
        tp_recv_counts = torch.full((tp_world_size,), rows.shape[0], dtype=torch.int32)
        # without expert_scales in, its values are not defined: non-zero here, so a lost round trip shows
        expand_scales = torch.arange(a, dtype=torch.float32) + 0.5 if a2 else None
        out = (expand_x, torch.zeros(a, dtype=torch.float32), expand_idx, expert_token_nums, ep_recv_counts,
               tp_recv_counts, expand_scales)
        st.mc2_dispatched[group_ep] = (expert_ids.clone(), out)
        return out

    @traced("npu_moe_distribute_combine")
    def _(expand_x, expert_ids, expand_idx, ep_send_counts, expert_scales, group_ep, ep_world_size, ep_rank_id,
          moe_expert_num, *, tp_send_counts=None, x_active_mask=None, activation_scale=None, weight_scale=None,
          group_list=None, expand_scales=None, shared_expert_x=None, group_tp="", tp_world_size=0, tp_rank_id=0,
          expert_shard_type=0, shared_expert_num=1, shared_expert_rank_num=0, global_bs=0, out_dtype=0,
          comm_quant_mode=0, group_list_type=0):
        bs, k = expert_ids.shape
        if any(t is not None for t in (x_active_mask, activation_scale, weight_scale, group_list, shared_expert_x)):
            raise ValueError("reserved parameters: leave them at their defaults")
        if comm_quant_mode != 0:
            raise NotImplementedError("emulation covers comm_quant_mode 0")
        group, a2 = mc2_group(group_ep, ep_world_size, ep_rank_id, moe_expert_num, group_tp, tp_world_size,
                              tp_rank_id, expert_shard_type, shared_expert_rank_num, global_bs, bs)
        ep, local, me = ep_world_size, moe_expert_num // ep_world_size, ep_rank_id
        a = bs * ep * min(local, k)
        if (expand_x.shape[0] != a * max(tp_world_size, 1) or expert_scales.dtype != torch.float32
                or expert_scales.shape != (bs, k) or expand_idx.dtype != torch.int32 or expand_idx.shape != (bs * k,)
                or ep_send_counts.dtype != torch.int32 or ep_send_counts.shape != (ep * local,)):
            raise ValueError("expand_x [A, H], expert_scales float32 [BS, K], expand_idx int32 [BS*K], "
                             "ep_send_counts int32 [ep*local]: the dispatch's")
        if a2 and (expand_scales is None or expand_scales.dtype != torch.float32 or expand_scales.shape != (a,)):
            raise ValueError("A2: expand_scales (float32 [A]) from the dispatch is required")
        if not a2 and (expand_scales is not None or tp_send_counts is None or tp_send_counts.shape != (tp_world_size,)):
            raise ValueError("A3: no expand_scales; tp_send_counts = the dispatch's tp_recv_counts")
        if st.capturing is None:  # the dispatch's own tensors come back (its values are opaque to the caller)
            ids0, out0 = st.mc2_dispatched.get(group_ep, (None, None))
            if ids0 is None or not (torch.equal(expert_ids.to(torch.int32), ids0) and torch.equal(expand_idx, out0[2])
                                    and torch.equal(ep_send_counts, out0[4])
                                    and (not a2 or torch.equal(expand_scales, out0[6]))
                                    and (a2 or torch.equal(tp_send_counts, out0[5]))):
                raise ValueError("combine must get its dispatch's expert_ids, expand_idx, ep_recv_counts "
                                 "(and expand_scales on A2 / tp_recv_counts on A3)")
        xs, counts = gather(expand_x, group), gather(ep_send_counts, group).long()  # [ep, A, H], [ep, ep*local]
        ids = expert_ids.long()
        dest, window = ids // local, (ids % local) * ep + me  # the (local expert, source rank) window on dest
        ends = counts[dest, window]
        starts = torch.where(window > 0, counts[dest, (window - 1).clamp(min=0)], 0)
        row = starts + expand_idx.view(bs, k).long()
        if st.capturing is None and bool((row >= ends).any()):
            raise ValueError("expand_idx points past its window: not this dispatch's")
        vals = xs[dest, row]  # [BS, K, H]
        return (vals.float() * expert_scales.unsqueeze(-1)).sum(1).to(expand_x.dtype)


    # ----- quantization (graphinfer/ops/npu/quant.py) -----
    # [OP] torch_npu-npu_dynamic_quant / aclnnDynamicQuant, -npu_quantize, -npu_quant_matmul,
    # -npu_weight_quant_batchmatmul, -npu_convert_weight_to_int4pack, aclnnAddRmsNormDynamicQuant,
    # aclnnAddRmsNormQuant (+ op-plugin AddRmsNormQuantKernelOpApi.cpp: scales2 must be None); [VA] w8a8 /
    # w8a8_dynamic and norm_quant_fusion_pass. Activations fp16 / bf16 only (documented, and enforced here: the
    # adapters send fp32 to the reference). Not documented, assumed here (and in the adapters): "round" is round
    # half to even, codes saturate to -128..127, an all-zero row gets scale 0 and codes 0, the fused norms compute
    # y = x / rms(x) * gamma in fp32 without rounding in between.
    def half_only(name, *ts):
        if any(t.dtype not in (torch.float16, torch.bfloat16) for t in ts):
            raise TypeError(f"{name}: float16 / bfloat16 inputs only, got {[t.dtype for t in ts]}")

    def int8_codes(v):
        return torch.round(v).clamp(-128, 127).to(torch.int8)

    def per_token(y):  # [.., K] fp32 -> (codes, scale [..]): rowmax|y| / 127, round(y / scale)
        scale = y.abs().amax(-1) / 127.0
        q = torch.where(scale.unsqueeze(-1) > 0, y / scale.unsqueeze(-1), torch.zeros_like(y))
        return int8_codes(q), scale

    def rms(x, gamma, eps):
        h = x.float()
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * gamma.float()

    @traced("npu_dynamic_quant")
    def _(x, *, smooth_scales=None, group_index=None, dst_type=None):
        half_only("npu_dynamic_quant", x)
        if smooth_scales is not None or group_index is not None or dst_type not in (None, torch.int8):
            raise NotImplementedError("emulation covers plain per-token int8 (no smooth_scales / group_index)")
        if x.dim() < 2:
            raise ValueError("npu_dynamic_quant: x with more than one dim")
        return per_token(x.float())

    # result = input * scales + zero_points (div_mode False) or input / scales + zero_points; scales 1-D along axis
    # (-1: the last dim) of that size or 1; dtype torch.qint8 -> an int8 tensor
    @traced("npu_quantize")
    def _(input, scales, zero_points, dtype, axis=1, div_mode=True):
        if dtype != torch.qint8 or axis != -1 or scales.dim() != 1 or scales.shape[0] not in (1, input.shape[-1]):
            raise NotImplementedError("emulation covers qint8 along the last axis with 1-D scales")
        if zero_points is not None and (zero_points.shape != scales.shape or zero_points.dtype != scales.dtype):
            raise ValueError("zero_points: the shape and dtype of scales")
        y = input.float() * scales.float() if not div_mode else input.float() / scales.float()
        return int8_codes(y if zero_points is None else y + zero_points.float())

    # int8 x1 (m, k) @ x2 (k, n) (a transposed view of (n, k) allowed); scale (1,) / (n,) fp32 or bf16;
    # pertoken_scale (m,) fp32; rows of the A2/A3 type table with pertoken_scale: output bf16 (bias int32 / bf16 /
    # fp32) or fp16 (scale fp32). out = (x1 @ x2) * scale * pertoken_scale + bias (a float bias after scaling).
    @traced("npu_quant_matmul")
    def _(x1, x2, scale, *, offset=None, pertoken_scale=None, bias=None, output_dtype=None, group_sizes=None):
        if x1.dtype != torch.int8 or x2.dtype != torch.int8 or x1.dim() != 2 or x2.dim() != 2:
            raise NotImplementedError("emulation covers 2-D int8 x int8")
        m, k = x1.shape
        n = x2.shape[1]
        if x2.shape[0] != k or max(k, x2.shape[1]) > 65535:
            raise ValueError(f"x1 (m, k), x2 (k, n), last dims <= 65535: got {tuple(x1.shape)}, {tuple(x2.shape)}")
        if (pertoken_scale is None or offset is not None or group_sizes is not None
                or pertoken_scale.dtype != torch.float32 or pertoken_scale.shape != (m,)):
            raise NotImplementedError("emulation covers the per-token form: pertoken_scale fp32 (m,), no offset")
        if scale.dim() != 1 or scale.shape[0] not in (1, n) or scale.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError("scale: 1-D (1,) or (n,), float32 or bfloat16")
        if output_dtype == torch.float16 and scale.dtype != torch.float32:
            raise ValueError("output float16 with pertoken_scale takes a float32 scale")
        if output_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"with pertoken_scale the output is bfloat16 or float16, not {output_dtype}")
        if bias is not None and (bias.shape != (n,) or bias.dtype not in (torch.int32, torch.bfloat16, torch.float32)):
            raise ValueError("bias: (n,), int32 / bfloat16 / float32")
        acc = (x1.double() @ x2.double()).float()  # exact int32 sums
        if bias is not None and bias.dtype == torch.int32:
            acc = acc + bias.float()
        out = acc * scale.float() * pertoken_scale.unsqueeze(-1)
        if bias is not None and bias.dtype != torch.int32:
            out = out + bias.float()
        return out.to(output_dtype)

    # int32 (rows, cols) values in [-8, 7], contiguous, cols % 8 == 0 -> int32 (rows, cols / 8), 8 int4 a word.
    # The word layout is internal ("交叠排放", interleaved): here nibble i of word j holds element 8j + i, and only
    # npu_weight_quant_batchmatmul below reads it.
    @traced("npu_convert_weight_to_int4pack")
    def _(weight, inner_k_tiles=0):
        if weight.dtype != torch.int32 or weight.dim() != 2 or not weight.is_contiguous() or weight.shape[1] % 8:
            raise ValueError("weight: contiguous 2-D int32 with the last dim a multiple of 8")
        if bool(((weight < -8) | (weight > 7)).any()):
            raise ValueError("int4 values lie in [-8, 7]")
        nib = (weight & 0xF).view(weight.shape[0], -1, 8).long()
        words = (nib << (4 * torch.arange(8))).sum(-1)
        return torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)

    def unpack_int4_words(words):  # (rows, cols / 8) -> (rows, cols) signed values
        w = words.long() & 0xFFFFFFFF
        nib = (w.unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF
        return torch.where(nib >= 8, nib - 16, nib).reshape(words.shape[0], -1)

    # y = x @ ((weight + antiquant_offset) * antiquant_scale) + bias. x (m, k) fp16/bf16; weight (k, n) int8, or
    # int32 int4: (k, n / 8) contiguous or (k / 8, n) the transposed view of an (n, k / 8) pack; antiquant_scale in
    # x's dtype, (n,) / (1, n) per channel or (ceil(k / g), n) per group with g = antiquant_group_size a multiple
    # of 32 in [32, k - 1]; offset of the scale's shape and dtype; bias (n,) fp32 for bf16 x, fp16 for fp16 x.
    @traced("npu_weight_quant_batchmatmul")
    def _(x, weight, antiquant_scale, antiquant_offset=None, quant_scale=None, quant_offset=None, bias=None,
          antiquant_group_size=0, inner_precise=0):
        half_only("npu_weight_quant_batchmatmul", x)
        if quant_scale is not None or quant_offset is not None:
            raise NotImplementedError("emulation covers a float output (no quant_scale)")
        m, k = x.shape
        if weight.dtype == torch.int8:
            w = weight.long()
        elif weight.dtype == torch.int32:
            if weight.is_contiguous():
                w = unpack_int4_words(weight)  # (k, n)
            elif weight.t().is_contiguous():
                w = unpack_int4_words(weight.t()).t()  # the transposed (n, k / 8) pack
            else:
                raise ValueError("int4 weight: a contiguous pack or its transpose")
        else:
            raise ValueError("weight: int8, or int32 carrying int4")
        n = w.shape[1]
        if w.shape[0] != k or max(k, n) > 65535:
            raise ValueError(f"x (m, k), weight (k, n), K and N <= 65535: got {tuple(x.shape)}, weight k x n = "
                             f"{tuple(w.shape)}")
        if antiquant_scale.dtype != x.dtype:
            raise ValueError("antiquant_scale: x's dtype")
        g = antiquant_group_size
        if g:
            if g % 32 or not 32 <= g <= k - 1 or antiquant_scale.shape != (-(-k // g), n):
                raise ValueError(f"per group: antiquant_group_size a multiple of 32 in [32, k - 1] and scale "
                                 f"(ceil(k / g), n); got g {g}, scale {tuple(antiquant_scale.shape)}")
            expand = lambda t: t.float().repeat_interleave(g, 0)[:k]  # noqa: E731
        else:
            if antiquant_scale.shape not in ((n,), (1, n), (1,), (1, 1)):
                raise ValueError(f"per channel / tensor: scale (n,), (1, n) or (1,); "
                                 f"got {tuple(antiquant_scale.shape)}")
            expand = lambda t: t.float().reshape(1, -1)  # noqa: E731
        if antiquant_offset is not None and (antiquant_offset.shape != antiquant_scale.shape
                                             or antiquant_offset.dtype != antiquant_scale.dtype):
            raise ValueError("antiquant_offset: the scale's shape and dtype")
        if bias is not None and (bias.shape not in ((n,), (1, n)) or bias.dtype != (
                torch.float32 if x.dtype == torch.bfloat16 else torch.float16)):
            raise ValueError("bias (n,): float32 with bfloat16 x, float16 with float16 x")
        wf = w.float() if antiquant_offset is None else w.float() + expand(antiquant_offset)
        y = x.float() @ (wf * expand(antiquant_scale))
        return (y if bias is None else y + bias.float().reshape(-1)).to(x.dtype)

    # -> (y1, y2, x, scale1, scale2): x = x1 + x2 (the inputs' dtype); y = rmsnorm(x) * gamma; y1 = round(y / scale1),
    # scale1 = rowmax|y| / 127 (shape x.shape[:-1]); y2 / scale2 "invalid output" unless output_mask[1] (or both
    # smooth scales): garbage here.
    @traced("npu_add_rms_norm_dynamic_quant")
    def _(x1, x2, gamma, *, smooth_scale1=None, smooth_scale2=None, beta=None, epsilon=1e-6, output_mask=None,
          y_dtype=None):
        half_only("npu_add_rms_norm_dynamic_quant", x1, x2)
        if smooth_scale1 is not None or smooth_scale2 is not None or beta is not None or y_dtype is not None:
            raise NotImplementedError("emulation covers no smooth scales, no beta")
        if list(output_mask or []) != [True, False]:
            raise NotImplementedError("emulation covers output_mask [True, False] (vllm-ascend's)")
        if x1.shape != x2.shape or x1.dtype != x2.dtype:
            raise ValueError("x1, x2: one shape and dtype")
        x = x1 + x2
        y1, scale1 = per_token(rms(x, gamma, epsilon))
        junk = torch.full(x.shape[:-1], float("nan"))
        return y1, torch.full_like(y1, 77), x, scale1, junk

    # -> (y1, y2, x): y1 = round(rmsnorm(x1 + x2) * gamma / scales1 + zero_points1) (div_mode True), scales1 along
    # the last axis; scales2 must be None (op-plugin: "scales only support None"), y2 then meaningless.
    @traced("npu_add_rms_norm_quant")
    def _(x1, x2, gamma, scales1, zero_points1=None, beta=None, scales2=None, zero_points2=None, *, axis=-1,
          epsilon=1e-6, div_mode=True):
        half_only("npu_add_rms_norm_quant", x1, x2)
        if scales2 is not None or zero_points2 is not None or beta is not None or axis != -1:
            raise NotImplementedError("emulation covers scales1 / zero_points1 along the last axis only")
        if scales1.shape not in ((x1.shape[-1],), (1,)):
            raise ValueError("scales1: (hidden,) or (1,)")
        x = x1 + x2
        y = rms(x, gamma, epsilon)
        y = y / scales1.float() if div_mode else y * scales1.float()
        if zero_points1 is not None:
            y = y + zero_points1.float()
        y1 = int8_codes(y)
        return y1, torch.full_like(y1, 77), x

    return m
