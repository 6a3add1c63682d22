"""Triton kernels for the graphinfer:: ops, one source for CUDA and Triton-Ascend.

TRITON_OPS maps op name -> a wrapper with exactly the reference op's signature; a platform registers them
per dispatch key (`lib.impl(name, fn, "CUDA")`). On CPU the same kernels run under TRITON_INTERPRET=1.
"""
import os
from typing import Callable


def _backport_interpreter_index_fix() -> None:
    """Let interpreted kernels use runtime loop bounds (`for t in range(lo, hi)` with tensor lo/hi).

    Triton <= 3.6's interpreter turns a scalar into a loop bound with int(array) on a 1-element array,
    which numpy >= 2.4 refuses (triton-lang/triton#9171, fixed upstream by #9172). Compiled kernels and
    Triton-Ascend's interpreter are unaffected; this re-applies the upstream fix so the kernels can keep
    the efficient loop form instead of being rewritten for an interpreter bug.
    """
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "_graphinfer_backport", False):
        return

    def patched(tensor, *args, **kwargs):
        patch(tensor, *args, **kwargs)
        # Set after the interpreter's own patch; its scope (if any) still restores the original afterwards.
        tensor.__index__ = lambda self: int(self.handle.data.reshape(-1)[0])

    patched._graphinfer_backport = True
    interpreter._patch_lang_tensor = patched


_backport_interpreter_index_fix()

from graphinfer.ops.triton.activation import gelu_and_mul, silu_and_mul  # noqa: E402
from graphinfer.ops.triton.attention import paged_attention  # noqa: E402
from graphinfer.ops.triton.bitmask import apply_token_bitmask  # noqa: E402
from graphinfer.ops.triton.block_fp8 import BLOCK_FP8_OPS  # noqa: E402
from graphinfer.ops.triton.fused_moe import fused_experts_op, fused_moe  # noqa: E402
from graphinfer.ops.triton.kv_cache import concat_and_cache_mla, reshape_and_cache  # noqa: E402
from graphinfer.ops.triton.lora import LORA_OPS  # noqa: E402
from graphinfer.ops.triton.mla_attention import mla_latent_attention  # noqa: E402
from graphinfer.ops.triton.norm import add_rms_norm, rms_norm  # noqa: E402
from graphinfer.ops.triton.qk_norm_rope import qk_norm_rope, qk_norm_rope_cache  # noqa: E402
from graphinfer.ops.triton.quant import QUANT_OPS  # noqa: E402
from graphinfer.ops.triton.rejection import rejection_sample  # noqa: E402
from graphinfer.ops.triton.rotary import rotary_embedding  # noqa: E402

TRITON_OPS: dict[str, Callable] = {
    "rms_norm": rms_norm,
    "add_rms_norm": add_rms_norm,
    "rotary_embedding": rotary_embedding,
    "qk_norm_rope": qk_norm_rope,
    "qk_norm_rope_cache": qk_norm_rope_cache,
    "silu_and_mul": silu_and_mul,
    "gelu_and_mul": gelu_and_mul,
    "reshape_and_cache": reshape_and_cache,
    "concat_and_cache_mla": concat_and_cache_mla,
    "paged_attention": paged_attention,
    "mla_latent_attention": mla_latent_attention,
    "fused_moe": fused_moe,
    "fused_experts": fused_experts_op,
    "rejection_sample": rejection_sample,
    "apply_token_bitmask": apply_token_bitmask,
    **QUANT_OPS,  # dynamic_quant, scaled_mm, wo_linear and the fused norm / activation + quant ops
    **BLOCK_FP8_OPS,  # block_fp8_linear (DeepSeek's block-FP8 weights kept in fp8)
    **LORA_OPS,  # lora_shrink, lora_expand (BGMV-style; npu's only kernels for them: torch_npu has no LoRA op)
}

__all__ = ["TRITON_OPS", "add_rms_norm", "apply_token_bitmask", "concat_and_cache_mla", "fused_moe", "gelu_and_mul", "mla_latent_attention", "paged_attention", "qk_norm_rope", "qk_norm_rope_cache",
           "reshape_and_cache", "rms_norm", "rotary_embedding", "silu_and_mul"]
