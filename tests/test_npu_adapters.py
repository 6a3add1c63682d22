"""Ascend platform on CPU: the torch_npu adapters against the reference ops, kernel-choice parsing, torch_npu
import hygiene, the FIA graph-update protocol, and whole models through the adapters — all run against
tests/npu_emulation.py (an emulation of torch_npu, not torch_npu: no NPU is needed or used here)."""
import contextlib
import os
import subprocess
import sys
import textwrap
import types

import numpy as np
import pytest
import torch
from torch import fx

import graphinfer.ops  # noqa: F401  (registers the graphinfer:: ops)
from graphinfer import LLM, SamplingParams
from graphinfer.runtime.worker.device_graphs import DecodeGraphs
from graphinfer.compiler.torchair_backend import compile_with_torchair
from graphinfer.errors import InvalidConfigError
from graphinfer.ops.npu.ops import NPU_OPS, NpuOps, mc2_fits
from graphinfer.platforms.cpu import CpuPlatform
from graphinfer.platforms.interface import Platform
from graphinfer.platforms.npu import NpuPlatform, parse_kernels
from npu_emulation import make_torch_npu

ref = torch.ops.graphinfer
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def ops():
    torch.manual_seed(0)
    return NpuOps(make_torch_npu())


# ----- adapters vs reference (fp32) -----

def test_norms_and_swiglu(ops):
    x, res, w = torch.randn(5, 32), torch.randn(5, 32), torch.randn(32)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6))
    for got, want in zip(ops.add_rms_norm(x, res, w, 1e-5), ref.add_rms_norm(x, res, w, 1e-5)):
        torch.testing.assert_close(got, want)
    y = torch.randn(3, 2, 64)
    torch.testing.assert_close(ops.silu_and_mul(y), ref.silu_and_mul(y))


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rot_dim", [32, 16])  # full and partial rotary
def test_rotary(ops, is_neox, rot_dim):
    T, head = 6, 32
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.outer(torch.arange(64).float(), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), -1)
    pos = torch.randint(0, 64, (T,))
    q, k = torch.randn(T, 4 * head), torch.randn(T, 2, head)  # flat [T, H*D] and [T, H, D]
    for got, want in zip(ops.rotary_embedding(pos, q, k, head, cache, is_neox),
                         ref.rotary_embedding(pos, q, k, head, cache, is_neox)):
        torch.testing.assert_close(got, want)
    assert ops.torch_npu.emulation_state.calls.count("npu_rotary_mul") == 2


@pytest.mark.parametrize("is_neox", [True, False])
def test_qk_norm_rope(ops, is_neox):
    T, heads, kv_heads, head, rot_dim = 5, 4, 2, 32, 16  # partial rotary
    inv = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2).float() / rot_dim))
    freqs = torch.outer(torch.arange(64).float(), inv)
    cache = torch.cat((freqs.cos(), freqs.sin()), -1)
    args = (torch.randn(T, (heads + 2 * kv_heads) * head), heads, kv_heads, head, 0.5 + torch.rand(head),
            1.5 + torch.rand(head), 1e-6, torch.randint(0, 64, (T,)), cache, is_neox)
    for got, want in zip(ops.qk_norm_rope(*args), ref.qk_norm_rope(*args)):
        torch.testing.assert_close(got, want)
    calls = ops.torch_npu.emulation_state.calls
    assert calls.count("npu_rms_norm") == 2 and calls.count("npu_rotary_mul") == 2


@pytest.mark.parametrize("slots", [[-1, 5, 40, -1, 7], [-1, -1, -1, -1, -1]])
def test_qk_norm_rope_cache(ops, slots):
    T, heads, kv_heads, head = 5, 4, 2, 32
    freqs = torch.outer(torch.arange(64).float(), 1.0 / (10000 ** (torch.arange(0, head, 2).float() / head)))
    args = (torch.randn(T, (heads + 2 * kv_heads) * head), heads, kv_heads, head, 0.5 + torch.rand(head),
            1.5 + torch.rand(head), 1e-6, torch.randint(0, 64, (T,)), torch.cat((freqs.cos(), freqs.sin()), -1), True)
    got_caches, want_caches = _kv(), _kv()
    for got, want in zip(got_caches, want_caches):
        want.copy_(got)
    torch.testing.assert_close(ops.qk_norm_rope_cache(*args, *got_caches, torch.tensor(slots)),
                               ref.qk_norm_rope_cache(*args, *want_caches, torch.tensor(slots)))
    for got, want in zip(got_caches, want_caches):
        torch.testing.assert_close(got, want)
    calls = ops.torch_npu.emulation_state.calls
    assert calls.count("npu_rotary_mul") == 2 and calls.count("npu_scatter_pa_kv_cache") == 1


def _kv(num_blocks=8, block_size=16, kv_heads=2, head=32):
    return torch.randn(num_blocks, block_size, kv_heads, head), torch.randn(num_blocks, block_size, kv_heads, head)


@pytest.mark.parametrize("slots", [[-1, 5, -1, 40, 7], [-1, -1, -1, -1, -1], [3, 4, 5, 6, 100], [-1, 17, 18, 19, -1]])
def test_reshape_and_cache_skips_padded_slots(ops, slots):
    k_cache, v_cache = _kv()
    key, value = torch.randn(5, 2, 64)[..., :32], torch.randn(5, 2, 32)  # k: a non-contiguous slice, as after fuse_qkv
    slot_mapping = torch.tensor(slots)
    got_k, got_v, want_k, want_v = k_cache.clone(), v_cache.clone(), k_cache.clone(), v_cache.clone()
    ops.reshape_and_cache(key, value, got_k, got_v, slot_mapping)
    ref.reshape_and_cache(key, value, want_k, want_v, slot_mapping)
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def test_emulated_scatter_refuses_slot_minus_one():
    """The documented slot range excludes -1, so the adapter must not pass it through (see the test above)."""
    tnpu = make_torch_npu()
    k_cache, v_cache = _kv()
    with pytest.raises(ValueError, match="slot_mapping values"):
        tnpu.npu_scatter_pa_kv_cache(torch.randn(2, 2, 32), torch.randn(2, 2, 32), k_cache, v_cache,
                                     torch.tensor([-1, 3]), cache_mode="Norm")


def _mixed_batch(heads=4, kv_heads=2, head=32, block_size=16):
    """A prefill chunk with cached context, decodes, a zero-length padded row, GQA 4:2."""
    q_lens, seq_lens = [5, 1, 1, 1, 3], [21, 20, 0, 3, 3]
    k_cache, v_cache = _kv(8, block_size, kv_heads, head)
    block_tables = torch.zeros(len(q_lens), 3, dtype=torch.int32)
    block_tables[0, :2] = torch.tensor([2, 6])
    block_tables[1, :2] = torch.tensor([4, 1])
    block_tables[3, 0] = 5
    block_tables[4, 0] = 7
    qsl = torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32)
    q = torch.randn(sum(q_lens), heads, head)
    return q, k_cache, v_cache, block_tables, qsl, torch.tensor(seq_lens, dtype=torch.int32), head ** -0.5


def test_paged_attention_mixed_batch_gqa_padded_rows(ops):
    args = _mixed_batch()
    got = ops.paged_attention(*args)
    torch.testing.assert_close(got, ref.paged_attention(*args))
    assert not got[6].any()  # the seq_len-0 row attends to nothing
    assert ops.torch_npu.emulation_state.calls == ["npu_fused_infer_attention_score"]


def test_paged_attention_features_run_the_triton_kernel(ops):
    """A sliding window, softcap or sinks: the Triton kernel (here interpreted), not FIA; equal to the reference."""
    args = _mixed_batch()
    features = dict(sliding_window=4, softcap=2.0, sinks=torch.randn(4))
    got = ops.paged_attention(*args, **features)
    torch.testing.assert_close(got, ref.paged_attention(*args, **features), rtol=2e-5, atol=2e-5)
    assert ops.torch_npu.emulation_state.calls == []


def _mla_batch(heads=4, latent=32, rope=16, block_size=16, q_lens=(5, 1, 1, 1, 3), seq_lens=(21, 20, 0, 3, 3)):
    """The mixed batch above as MLA sees it: a latent cache [blocks, block_size, 1, L + R], strided q_latent."""
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(8, block_size, 1, latent + rope, generator=g)
    block_tables = torch.tensor([[2, 6, 0], [4, 1, 0], [0, 0, 0], [5, 0, 0], [7, 0, 0]],
                                dtype=torch.int32)[:len(q_lens)]
    qsl = torch.tensor(np.cumsum([0, *q_lens]), dtype=torch.int32)
    T = sum(q_lens)
    q_latent = torch.randn(heads, T, latent, generator=g).transpose(0, 1)
    q_pe = torch.randn(T, heads, rope, generator=g)
    return q_latent, q_pe, cache, block_tables, qsl, torch.tensor(seq_lens, dtype=torch.int32), (latent + rope) ** -0.5


def test_mla_latent_attention_mixed_batch_padded_rows(ops):
    """FIA (plain form, one KV head of L + R) through the paged_attention adapter, sliced to L."""
    args = _mla_batch()
    got = ops.mla_latent_attention(*args)
    torch.testing.assert_close(got, ref.mla_latent_attention(*args))
    assert got.shape == args[0].shape and not got[6].any()
    assert ops.torch_npu.emulation_state.calls == ["npu_fused_infer_attention_score"]


def test_mla_latent_attention_fia_capture_update_replay():
    """A FULL_DECODE_ONLY decode graph with the MLA adapter (kernels="torch_npu"): FIA captured behind an
    ExternalEvent, each step's lengths and queries flow in before replay."""
    platform = NpuPlatform(make_torch_npu())
    ops = platform.ops
    q_latent, q_pe, cache, bt, _, _, scale = _mla_batch(q_lens=(1, 1, 1), seq_lens=(21, 3, 0))
    q_latent, q_pe = q_latent[:3].clone(), q_pe[:3].clone()
    qsl, lens = torch.arange(4, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)  # static buffers
    args = (q_latent, q_pe, cache, bt[:3], qsl, lens, scale)
    ops.mla_latent_attention(*args)  # warm-up, as DecodeGraphs does
    graph = platform.graph_class()()
    with platform.graph_capture(graph, platform.graph_pool_handle(), platform.new_stream()):
        out = ops.mla_latent_attention(*args)
    assert len(ops.graph_params.tasks[graph]) == 1
    for step in ([21, 3, 0], [7, 16, 1]):
        q_latent.copy_(torch.randn_like(q_latent))
        lens.copy_(torch.tensor(step))
        platform.before_graph_replay(graph, np.array(step))
        graph.replay()
        torch.testing.assert_close(out, ref.mla_latent_attention(*args))


@pytest.mark.parametrize("slots", [[3, 17, 40], [-1, 9, -1], [-1, -1, -1]])
def test_concat_and_cache_mla(ops, slots):
    """npu_scatter_nd_update_ on the cache's rows; padded rows (-1) leave the cache as the reference does."""
    kv_c, k_pe = torch.randn(3, 32), torch.randn(3, 16)
    cache = torch.randn(4, 16, 1, 48)
    expected = cache.clone()
    slot_mapping = torch.tensor(slots)
    ref.concat_and_cache_mla(kv_c, k_pe, expected, slot_mapping)
    ops.concat_and_cache_mla(kv_c, k_pe, cache, slot_mapping)
    torch.testing.assert_close(cache, expected, rtol=0, atol=0)
    assert ops.torch_npu.emulation_state.calls == ["npu_scatter_nd_update_"]


def test_emulated_scatter_nd_update_refuses_slot_minus_one():
    tnpu = make_torch_npu()
    with pytest.raises(ValueError, match="indices must be in"):
        tnpu.npu_scatter_nd_update_(torch.zeros(4, 8), torch.tensor([[-1], [2]]), torch.ones(2, 8))


def test_emulated_fia_checks_the_length_conventions():
    """TND wants cumulative query lengths and host lists; per-request lengths or device tensors fail."""
    tnpu = make_torch_npu()
    q, k_cache, v_cache, bt, qsl, seq_lens, scale = _mixed_batch()
    kw = dict(key=k_cache.view(8, 16, -1), value=v_cache.view(8, 16, -1), block_table=bt, input_layout="TND",
              block_size=16, num_heads=4, num_key_value_heads=2, scale=scale, sparse_mode=3,
              atten_mask=torch.triu(torch.ones(2048, 2048), 1).to(torch.int8))
    kv = [21, 20, 1, 3, 3]
    with pytest.raises(ValueError, match="cumulative|last cumulative"):
        tnpu.npu_fused_infer_attention_score(q, **kw, actual_seq_lengths=[5, 1, 1, 1, 3], actual_seq_lengths_kv=kv)
    with pytest.raises(TypeError, match="host list"):
        tnpu.npu_fused_infer_attention_score(q, **kw, actual_seq_lengths=qsl[1:], actual_seq_lengths_kv=kv)
    with pytest.raises(ValueError, match="KV length of 0"):
        tnpu.npu_fused_infer_attention_score(q, **kw, actual_seq_lengths=qsl[1:].tolist(),
                                             actual_seq_lengths_kv=seq_lens.tolist())


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_with_empty_experts(ops, renormalize):
    T, H, inter, E, K = 7, 16, 8, 6, 2
    hidden, logits = torch.randn(T, H), torch.randn(T, E)
    logits[:, [2, 4]] -= 100  # experts 2 and 4 get no tokens
    w13, w2 = torch.randn(E, 2 * inter, H) * 0.3, torch.randn(E, H, inter) * 0.3
    torch.testing.assert_close(ops.fused_moe(hidden, logits, w13, w2, K, renormalize),
                               ref.fused_moe(hidden, logits, w13, w2, K, renormalize))
    calls = ops.torch_npu.emulation_state.calls
    assert calls.count("npu_grouped_matmul") == 2 and "npu_moe_token_unpermute" in calls


# ----- kernel choices -----

def _triton():
    from graphinfer.ops.triton import TRITON_OPS

    return TRITON_OPS


def test_kernel_choice_parsing():
    default = parse_kernels(None, NPU_OPS)
    triton_default = ("paged_attention", "mla_latent_attention", "lora_shrink", "lora_expand")  # LoRA: no torch_npu op
    assert all(default[op] == "triton" for op in triton_default)
    assert all(default[op] == "torch_npu" for op in NPU_OPS if op not in triton_default)
    assert parse_kernels("torch_npu", NPU_OPS) == {op: "torch_npu" for op in NPU_OPS}
    assert parse_kernels("triton", NPU_OPS) == {op: "triton" for op in _triton()}
    assert parse_kernels("reference", NPU_OPS) == {}
    assert parse_kernels("torch_npu,paged_attention=triton,mla_latent_attention=triton,lora_shrink=triton,"
                         "lora_expand=triton", NPU_OPS) == default
    rms = parse_kernels(" rms_norm=triton ", NPU_OPS)
    assert rms["rms_norm"] == "triton" and rms["paged_attention"] == "triton" and rms["fused_moe"] == "torch_npu"
    assert "fused_moe" not in parse_kernels("torch_npu,fused_moe=reference", NPU_OPS)


@pytest.mark.parametrize("spec, message", [
    ("cuda", "unknown kernel choice 'cuda'.*torch_npu, triton, reference"),
    ("triton,torch_npu", "one base choice"),
    ("attention=triton", "unknown op 'attention'.*paged_attention"),
    ("rms_norm=fast", "unknown kernel choice 'fast'"),
    ("moe_combine=torch_npu", "moe_combine has no torch_npu implementation; choices for moe_combine: .*reference"),
])
def test_kernel_choice_errors(spec, message):
    with pytest.raises(InvalidConfigError, match=message):
        parse_kernels(spec, NPU_OPS)


def test_op_impls_bind_adapters_and_triton_kernels():
    platform = NpuPlatform(make_torch_npu())
    impls = platform.op_impls(None)
    assert impls["paged_attention"] is _triton()["paged_attention"]
    assert impls["rms_norm"].__self__ is platform.ops and impls["rms_norm"].__name__ == "rms_norm"
    assert set(platform.op_impls("torch_npu")) == set(NPU_OPS)
    assert impls["ep_dispatch"].__self__ is platform.ops and impls["ep_combine"].__name__ == "ep_combine"  # MC2
    assert "ep_dispatch" not in platform.op_impls("reference")


def test_mc2_is_used_only_within_its_documented_limits():
    """Outside them the ep adapters run the all_to_all reference (the MC2 path itself: tests/test_distributed_ops.py,
    on two gloo ranks against the emulation)."""
    bf16, a2, a3 = torch.bfloat16, 223, 253
    assert mc2_fits(a2, 256, 8, 4096, bf16, 128, 16)  # A2: ep 16, 8 experts a rank, BS <= 256, H % 32 == 0
    assert not mc2_fits(a2, 257, 8, 4096, bf16, 128, 16)
    assert not mc2_fits(a2, 16, 8, 4096, bf16, 128, 8)  # A2: ep 16, 32 or 64 only
    assert not mc2_fits(a2, 16, 8, 4096, bf16, 512, 16)  # A2: <= 24 experts a rank
    assert not mc2_fits(a2, 16, 8, 4100, bf16, 128, 16)  # H a multiple of 32
    assert mc2_fits(a3, 512, 8, 7168, bf16, 256, 8)  # A3: H 7168 only, ep from 8
    assert not mc2_fits(a3, 16, 8, 4096, bf16, 256, 8)
    assert not mc2_fits(a3, 16, 8, 7168, bf16, 256, 2)
    assert not mc2_fits(a3, 16, 8, 7168, torch.float32, 256, 8)  # bf16 / fp16 only
    assert not mc2_fits(202, 16, 8, 7168, bf16, 256, 8)  # 310P: no MC2


# ----- torch_npu import hygiene (subprocesses: a fake torch_npu package with a torch.backends entry point) -----

def _fake_torch_npu(tmp_path, body: str):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    dist = tmp_path / "torch_npu-0.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: torch_npu\nVersion: 0.0\n")
    (dist / "entry_points.txt").write_text("[torch.backends]\ntorch_npu = torch_npu:_autoload\n")  # as torch_npu's
    return tmp_path


def _run(code: str, path, **extra_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ASCEND", "GRAPHINFER_PLATFORM", "TORCH_DEVICE"))}
    env.update(PYTHONPATH=f"{path}{os.pathsep}{REPO}", **extra_env)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_broken_torch_npu_autoload_and_graphinfer_imports(tmp_path):
    """torch_npu installed without CANN: `import torch` fails through torch's backend autoload (the caveat
    docs/ascend.md explains); with TORCH_DEVICE_BACKEND_AUTOLOAD=0 graphinfer imports, detects and runs on cpu
    without touching torch_npu, and only selecting npu tries to import it (with a clear error)."""
    path = _fake_torch_npu(tmp_path, """
        raise ImportError("libhccl.so: cannot open shared object file (emulated missing CANN)")
        """)
    broken = _run("import torch", path)
    assert broken.returncode != 0 and "Failed to load the backend extension: torch_npu" in broken.stderr
    done = _run("""
        import os, sys
        import graphinfer, graphinfer.ops, graphinfer.ops.npu.ops, graphinfer.compiler.torchair_backend
        import graphinfer.runtime.entrypoints.llm_engine
        from graphinfer.errors import InvalidConfigError
        from graphinfer.platforms import available_platforms, current_platform, get_platform
        from graphinfer.platforms.npu import NpuPlatform
        assert current_platform().name == "cpu" and not NpuPlatform.is_available()
        os.environ["ASCEND_HOME_PATH"] = "/usr/local/Ascend/ascend-toolkit/latest"
        assert NpuPlatform.is_available() and "npu" in available_platforms()
        assert "torch_npu" not in sys.modules, "detection imported torch_npu"
        try:
            get_platform("npu").activate()
        except InvalidConfigError as e:
            assert "set_env.sh" in str(e) and "libhccl" in str(e), e
        else:
            raise AssertionError("selecting npu did not try to import torch_npu")
        print("ok")
        """, path, TORCH_DEVICE_BACKEND_AUTOLOAD="0")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_selected_npu_platform_imports_torch_npu(tmp_path):
    path = _fake_torch_npu(tmp_path, """
        import types
        npu = types.SimpleNamespace()
        def _autoload():
            pass
        """)
    done = _run("""
        import sys
        from graphinfer.platforms import current_platform
        p = current_platform()
        assert p.name == "npu" and "torch_npu" not in sys.modules
        p.activate("torch_npu")
        assert "torch_npu" in sys.modules and p.kernels["paged_attention"] == "graphinfer.ops.npu.ops"
        print("ok")
        """, path, TORCH_DEVICE_BACKEND_AUTOLOAD="0", GRAPHINFER_PLATFORM="npu")
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


# ----- FULL_DECODE_ONLY: the replay hook and FIA's graph-task update -----

class _HookPlatform(CpuPlatform):
    """Logs the DecodeGraphs hook and replays, with a do-nothing device graph (tests only)."""
    supports_graph_capture = True
    capture_graph = Platform.capture_graph  # a device platform's capture, not the cpu platform's traces

    def __init__(self):
        super().__init__()
        self.events = []

    def graph_class(self):
        events = self.events

        class LoggedGraph:
            def replay(self):
                events.append(("replay", self))
        return LoggedGraph

    def graph_pool_handle(self):
        return None

    def new_stream(self):
        return None

    def graph_capture(self, graph, pool, stream):
        return contextlib.nullcontext()

    def before_graph_replay(self, graph, seq_lens):
        self.events.append(("update", graph, seq_lens.tolist()))


def test_decode_graphs_hand_host_lengths_to_the_platform_before_replay():
    platform = _HookPlatform()
    graphs = DecodeGraphs(lambda ids, pos, md: md.seq_lens.float()[:, None], platform, torch.device("cpu"), [2, 4],
                          max_blocks_per_seq=2)
    graphs.capture(progress=False)
    i64 = np.arange(3, dtype=np.int64)
    graphs.replay(i64, i64, i64, np.zeros((3, 2), dtype=np.int32), np.array([5, 6, 7], dtype=np.int32))
    g = graphs.graphs[4]
    assert platform.events == [("update", g, [5, 6, 7, 0]), ("replay", g)]  # padded to the bucket, before replay


def test_fia_capture_update_replay():
    """FIA captured in a task group behind an ExternalEvent; each step's lengths are patched in before replay."""
    platform = NpuPlatform(make_torch_npu())
    ops = platform.ops
    q, k_cache, v_cache, _, _, _, scale = _mixed_batch()
    q = torch.randn(4, 4, 32)
    block_tables = torch.tensor([[2, 6, 0], [4, 1, 0], [0, 0, 0], [5, 0, 0]], dtype=torch.int32)
    qsl, seq_lens = torch.arange(5, dtype=torch.int32), torch.zeros(4, dtype=torch.int32)  # static buffers
    args = (q, k_cache, v_cache, block_tables, qsl, seq_lens, scale)
    ops.paged_attention(*args)  # warm-up, as DecodeGraphs does
    graph = platform.graph_class()()
    with platform.graph_capture(graph, platform.graph_pool_handle(), platform.new_stream()):
        out = ops.paged_attention(*args)
    assert list(ops.graph_params.workspaces) == [4] and len(ops.graph_params.tasks[graph]) == 1
    with pytest.raises(RuntimeError, match="would hang"):
        graph.replay()  # no update issued: the captured task would wait forever
    for lens in ([9, 17, 0, 3], [30, 2, 0, 16]):
        q.copy_(torch.randn_like(q))
        seq_lens.copy_(torch.tensor(lens))
        platform.before_graph_replay(graph, np.array(lens))
        graph.replay()
        torch.testing.assert_close(out, ref.paged_attention(*args))
        assert not out[2].any()
    with pytest.raises(RuntimeError, match="would hang"):
        graph.replay()  # each replay consumes its update


# ----- whole models through the adapters (emulated torch_npu on CPU tensors) -----

class EmulatedNpuPlatform(NpuPlatform):
    """NpuPlatform on CPU tensors with the emulated torch_npu: its adapters register for the CPU key (tests only)."""
    name = "npu-emulated"
    device_type = "cpu"
    dispatch_key = "CPU"


PROMPTS = [[1, 5, 9, 3], [7] * 11, list(range(2, 40)), [4, 4, 8], list(range(100, 121))]


def _tokens(llm):
    params = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3-moe"])
def test_models_through_the_adapters_match_reference(model, monkeypatch):
    import graphinfer.runtime.entrypoints.llm_engine as llm_engine

    kw = dict(max_num_seqs=8, num_gpu_blocks_override=32, block_size=16, dtype="float32")
    expected = _tokens(LLM(model, **kw))
    platform = EmulatedNpuPlatform(make_torch_npu())
    monkeypatch.setattr(llm_engine, "platform_for_device", lambda device_type: platform)
    try:
        assert _tokens(LLM(model, kernels="torch_npu", graph_mode="NONE", **kw)) == expected
        llm = LLM(model, kernels="torch_npu", graph_mode="FULL_DECODE_ONLY", capture_sizes=[1, 2, 4], **kw)
        assert _tokens(llm) == expected
        calls = platform.torch_npu.emulation_state.calls
        assert "npu_fused_infer_attention_score.out" in calls and "npu_add_rms_norm" in calls
        if model.endswith("moe"):
            assert "npu_moe_init_routing_v2" in calls
        assert sorted(len(t) for t in platform.ops.graph_params.tasks.values()) == [2, 2, 2]  # 2 layers per graph
        # The platform's default, FULL_AND_PIECEWISE: pieces as NPUGraphs, FIA eager (host lengths) on padded
        # token counts between them; the decode graphs as above.
        llm = LLM(model, kernels="torch_npu", capture_sizes=[1, 2, 4, 8, 32, 64], **kw)
        assert llm.llm_engine.config.compile_config.graph_mode == "FULL_AND_PIECEWISE"
        assert _tokens(llm) == expected
        assert sorted(llm.llm_engine.worker.model_runner.dispatcher.piecewise_graphs.captured_sizes) == [1, 2, 4, 8, 32, 64]
    finally:
        platform._impl_lib._destroy()  # the CPU key gets the reference ops back


# ----- torchair -----

def _gm():
    return fx.symbolic_trace(torch.nn.Linear(4, 3))


def test_torchair_errors():
    gm = _gm()
    with pytest.raises(InvalidConfigError, match="use one of npugraph_ex, reduce-overhead"):
        compile_with_torchair(gm, "max-autotune")
    with pytest.raises(InvalidConfigError, match="FIA"):
        compile_with_torchair(gm, kernels={"paged_attention": "graphinfer.ops.npu.ops"})
    with pytest.raises(InvalidConfigError, match="needs torch_npu"):  # not installed here
        compile_with_torchair(gm)


def test_torchair_backend_wiring(monkeypatch):
    modes = []
    fake_npu = types.ModuleType("torch_npu")
    fake_npu.npu = types.SimpleNamespace(set_compile_mode=lambda jit_compile: modes.append(jit_compile))
    monkeypatch.setitem(sys.modules, "torch_npu", fake_npu)
    monkeypatch.setitem(sys.modules, "npugraph_ex", None)
    monkeypatch.setitem(sys.modules, "torchair", None)
    with pytest.raises(InvalidConfigError, match="torchair is missing"):
        compile_with_torchair(_gm())
    configs = []
    fake_air = types.ModuleType("torchair")
    fake_air.CompilerConfig = lambda: types.SimpleNamespace(
        mode="max-autotune", debug=types.SimpleNamespace(aclgraph=types.SimpleNamespace()))

    def get_npu_backend(compiler_config):
        configs.append(compiler_config)
        return lambda gm, example_inputs: gm.forward
    fake_air.get_npu_backend = get_npu_backend
    monkeypatch.setitem(sys.modules, "torchair", fake_air)
    gm, x = _gm(), torch.randn(2, 4)
    torch.testing.assert_close(compile_with_torchair(gm, "reduce-overhead")(x), gm(x))
    assert configs[0].mode == "reduce-overhead" and configs[0].debug.aclgraph.disable_reinplace_inplaceable_ops_pass
    assert modes == [False, False]


def test_npu_compiler_config_errors():
    from graphinfer import LLM
    from graphinfer.config import CompileConfig

    with pytest.raises(InvalidConfigError, match="use it with graph_mode='NONE'"):
        CompileConfig(graph_mode="FULL_DECODE_ONLY", npu_compiler="torchair")
    with pytest.raises(InvalidConfigError, match="use 'torchair'"):
        CompileConfig(npu_compiler="inductor")
    with pytest.raises(InvalidConfigError, match="needs the npu platform; this engine runs on cpu"):
        LLM("tiny-llama", npu_compiler="torchair", device="cpu")


def test_fused_experts_as_expert_parallel_feeds_it(ops):
    """Expert parallel's local experts: one slot per row (K = 1), int64 ids, weight 0 and a zero row for the
    slots of other ranks' experts (id clamped to 0), as MoEExperts passes them."""
    N, H, inter, E = 10, 16, 8, 4
    rows, ids = torch.randn(N, H), torch.randint(0, E, (N, 1))
    weights = torch.ones(N, 1)
    rows[::3], ids[::3], weights[::3] = 0, 0, 0
    w13, w2 = torch.randn(E, 2 * inter, H) * 0.3, torch.randn(E, H, inter) * 0.3
    got = ops.fused_experts(rows, ids, weights, w13, w2)
    torch.testing.assert_close(got, ref.fused_experts(rows, ids, weights, w13, w2))
    assert torch.equal(got[::3], torch.zeros_like(got[::3]))
