"""LoRA adapters: the request that names one (request.py, vLLM's LoRARequest), PEFT's on-disk format read into
per-module A / B weights with the scaling folded in (peft.py), and the host-side LRU of loaded adapters
(cpu_cache.py, vLLM's max_cpu_loras)."""
from graphinfer.lora.cpu_cache import LoRACPUCache
from graphinfer.lora.peft import LoRAAdapter, LoRALayerWeights, load_adapter
from graphinfer.lora.request import LoRARequest

__all__ = ["LoRACPUCache", "LoRAAdapter", "LoRALayerWeights", "LoRARequest", "load_adapter"]
