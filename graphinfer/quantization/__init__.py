"""Quantized weights: schemes, packing, the quantized linear layer, and the GGUF / compressed-tensors readers."""
