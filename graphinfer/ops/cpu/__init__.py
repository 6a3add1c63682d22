"""The cpu platform's implementations of the graphinfer:: ops: C++ kernels of csrc/cpu/ (built by ext.py into
_cpu_kernels.so beside it) behind Python wrappers that fall back to the PyTorch references where the library is
missing or an input does not fit, plus xgrammar's bitmask kernel. platforms/cpu.py registers them.

attention.py (paged attention, cache write), elementwise.py (rms_norm, add_rms_norm, rotary, silu_and_mul),
quant.py (quantized linears), gemv.py (few-row dense linear), bitmask.py (structured outputs' mask), ext.py (build
and load the library).
"""
