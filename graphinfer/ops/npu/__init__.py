"""The npu platform's implementations of the graphinfer:: ops: thin adapters onto torch_npu's fused ops (Ascend).

ops.py: NpuOps (norms, rotary, attention, MoE, expert-parallel dispatch / combine) and its helpers; quant.py: the
quantization adapters NpuOps inherits. Importing them never imports torch_npu (platforms/npu.py passes it in).
"""
