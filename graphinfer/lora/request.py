"""LoRARequest: which adapter a request runs with (vLLM's `vllm.lora.request.LoRARequest`).

As in vLLM, `lora_int_id` (>= 1) is the adapter's id in the engine's caches and slots, and two requests are the
same adapter when their `lora_name`s are equal (equality and hash go by name only). A plain dataclass, so it
pickles to worker processes.
"""
from dataclasses import dataclass

from graphinfer.errors import InvalidRequestError


@dataclass(eq=False)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self):
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise InvalidRequestError(f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer >= 1 (0 "
                                      f"means 'no adapter'), got {self.lora_int_id!r}. Give each adapter its own id "
                                      f"from 1 up.")
        if not self.lora_path:
            raise InvalidRequestError(f"LoRARequest {self.lora_name!r}: lora_path cannot be empty; pass the "
                                      f"directory PEFT's save_pretrained wrote (adapter_config.json + "
                                      f"adapter_model.safetensors).")

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    def __eq__(self, other: object) -> bool:
        return isinstance(other, self.__class__) and self.lora_name == other.lora_name

    def __hash__(self) -> int:
        return hash(self.lora_name)
