"""How one linear layer is quantized: the scheme every format (online, GGUF, compressed-tensors) resolves to.

A quantized linear `P` holds, in place of its float weight (names as compressed-tensors / vLLM):
- `P.weight`: the codes: int8 [N, K] (bits 8), uint8 [N, K // 2] (bits 4, two codes a byte, see ops/quant.py)
  or float8_e4m3fn [N, K] (fp8);
- `P.weight_scale`: fp32 [N] for the activation-quantized schemes (per output channel), [N, K // group_size] for
  weight-only ones, [ceil(N / bn), ceil(K / bk)] for block FP8 (weight_block (bn, bk): DeepSeek-V3's
  weight_scale_inv, kept in fp8 where the platform has an fp8 GEMM, quantization/fp8.py);
- `P.weight_zero`: fp32 [N, K // group_size] (weight-only, asymmetric: w = q * scale + zero), absent otherwise;
  weight-only scales and zeros are fp16 where the scheme says so (scale_dtype: GGUF's Q4_0 / Q4_1 / Q8_0 keep their
  file's width, a sixth less weight traffic than fp32 for 4-bit codes);
- `P.input_scale`: fp32 [1], a static activation scale (compressed-tensors' static W8A8), absent when dynamic;
- `P.bias`: as the float layer's.
"""
from dataclasses import dataclass


@dataclass(frozen=True)
class QuantScheme:
    """act_dtype None: weight-only (graphinfer::wo_linear, activations stay float); "int8" / "fp8": activations
    quantized per token (graphinfer::dynamic_quant) and the GEMM on codes (graphinfer::scaled_mm); with
    weight_block, per token per bk-column group inside graphinfer::block_fp8_linear."""
    bits: int                     # weight code width: 8 (int8 or fp8) or 4
    group_size: int | None = None  # weight-only: K elements per scale (None = the whole row, per channel)
    act_dtype: str | None = None  # None (weight-only), "int8" or "fp8"
    has_zero: bool = False        # weight-only: a per-group zero (Q4_1, Q4_K, asymmetric int4)
    static_input: bool = False    # act_dtype set: a checkpoint's static input_scale instead of per-token scales
    weight_fp8: bool = False      # codes are float8_e4m3fn (the fp8 scheme)
    weight_block: tuple[int, int] | None = None  # block FP8: (bn, bk) weight blocks, activations per bk-column group
    scale_dtype: str = "float32"  # weight-only: "float16" or "float32" scales and zeros

    def __post_init__(self):
        if self.weight_block is not None:  # a manifest's JSON list -> the tuple (hashable, comparable)
            object.__setattr__(self, "weight_block", tuple(int(b) for b in self.weight_block))

    @property
    def block_fp8(self) -> bool:
        """Block-scaled FP8 (graphinfer::block_fp8_linear), not per-channel scaled_mm."""
        return self.weight_block is not None

    @property
    def weight_only(self) -> bool:
        return self.act_dtype is None

    def group(self, in_features: int) -> int:
        return self.group_size or in_features

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


# The online schemes (quantization="..." on an unquantized checkpoint), vLLM's names where vLLM has one.
ONLINE_SCHEMES = {
    "w8a8": QuantScheme(bits=8, act_dtype="int8"),            # int8 per-channel weights, dynamic per-token int8 acts
    "fp8": QuantScheme(bits=8, act_dtype="fp8", weight_fp8=True),  # vLLM's dynamic FP8 (cuda)
    "int8_wo": QuantScheme(bits=8),                           # int8 per-channel weights (torchao's int8_weight_only)
    "int4_wo": QuantScheme(bits=4, group_size=128, has_zero=True),  # asymmetric int4, group 128
}


def block_fp8_scheme(block: tuple[int, int]) -> QuantScheme:
    """A block-FP8 checkpoint's layers kept in fp8 (quantization/fp8.py)."""
    return QuantScheme(bits=8, act_dtype="fp8", weight_fp8=True, weight_block=tuple(block))
