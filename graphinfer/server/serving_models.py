"""The models a server serves, as vLLM's OpenAIServingModels: the base model and its LoRA adapters.

- `serve --enable-lora --lora-modules NAME=PATH ...` (or vLLM's JSON form '{"name": ..., "path": ...,
  "base_model_name": ...}'): each adapter gets the next int id (1, 2, ...) and is read and checked at start-up.
- /v1/models lists the base model, then each adapter with `parent` (the base model's name) and `root` (its path).
- A request's `model` picks its adapter (lora_for): the base model's name (or none) runs without one; an unknown name
  is vLLM's 404 ("The model `x` does not exist.").
- /v1/load_lora_adapter and /v1/unload_lora_adapter, when GRAPHINFER_ALLOW_RUNTIME_LORA_UPDATING is true (vLLM's
  VLLM_ALLOW_RUNTIME_LORA_UPDATING): load / unload with vLLM's bodies, messages and status codes.

Importable without the server's dependencies (the CLI parses --lora-modules with parse_lora_module).
"""
import argparse
import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, fields

from graphinfer import envs
from graphinfer.errors import LoRAAdapterError
from graphinfer.lora.request import LoRARequest
from graphinfer.server.errors import APIError

logger = logging.getLogger(__name__)


@dataclass
class LoRAModulePath:
    """One --lora-modules entry (vLLM's LoRAModulePath)."""
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(item: str) -> LoRAModulePath:
    """An argparse type: NAME=PATH, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...}."""
    if not item.lstrip().startswith("{"):
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise argparse.ArgumentTypeError(f"{item!r}: give NAME=PATH (an adapter's name and its PEFT directory) or "
                                             f'JSON: \'{{"name": "NAME", "path": "PATH"}}\'')
        return LoRAModulePath(name, path)
    try:
        spec = json.loads(item)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"Invalid JSON format for --lora-modules: {item} ({e})") from None
    known = [f.name for f in fields(LoRAModulePath)]
    if not isinstance(spec, dict) or set(spec) - set(known) or not all(isinstance(spec.get(k), str) and spec[k]
                                                                       for k in ("name", "path")):
        raise argparse.ArgumentTypeError(f"Invalid fields for --lora-modules: {item}: give \"name\" and \"path\" "
                                         f"(strings) and optionally \"base_model_name\"; no other field")
    return LoRAModulePath(**spec)


def runtime_lora_updating() -> bool:
    """GRAPHINFER_ALLOW_RUNTIME_LORA_UPDATING as vLLM reads its variable: 1 or true (any case) turns it on."""
    return (envs.get("GRAPHINFER_ALLOW_RUNTIME_LORA_UPDATING") or "").strip().lower() in ("1", "true")


def _not_found(model: str) -> APIError:
    return APIError(404, f"The model `{model}` does not exist.", "NotFoundError")


class ServingModels:
    """The base model and the adapters loaded now. load / unload block (the engine reads an adapter): the server runs
    them on a worker thread; a lock makes each one whole (no two adapters of one name)."""

    def __init__(self, engine, base_model_name: str, base_model_path: str, max_model_len: int):
        self.engine = engine  # anything with add_lora / remove_lora (AsyncLLMEngine, LLMEngine)
        self.base_model_name, self.base_model_path, self.max_model_len = base_model_name, base_model_path, max_model_len
        self.lora_requests: dict[str, LoRARequest] = {}
        self._last_id = 0
        self._lock = threading.Lock()

    # ----- a request's model -----
    def check(self, model: str | None) -> None:
        """404 unless `model` is served (the base model or an adapter; none means the base model)."""
        self.lora_for(model)

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's `model` names: None for the base model (or no name); vLLM's 404 for an unknown
        name."""
        if not model or model == self.base_model_name:
            return None
        lora = self.lora_requests.get(model)
        if lora is None:
            raise _not_found(model)
        return lora

    def model_name(self, lora: LoRARequest | None) -> str:
        """The `model` a response carries: the adapter's name, else the base model's (vLLM's)."""
        return lora.lora_name if lora is not None else self.base_model_name

    # ----- /v1/models -----
    def show_available_models(self) -> dict:
        cards = [self._card(self.base_model_name, self.base_model_path, None, self.max_model_len)]
        cards += [self._card(lora.lora_name, lora.lora_path, lora.base_model_name or self.base_model_name, None)
                  for lora in list(self.lora_requests.values())]
        return {"object": "list", "data": cards}

    @staticmethod
    def _card(model_id: str, root: str, parent: str | None, max_model_len: int | None) -> dict:
        """vLLM's ModelCard (owned_by graphinfer), its permission entry included."""
        created = int(time.time())
        permission = {"id": f"modelperm-{uuid.uuid4().hex}", "object": "model_permission", "created": created,
                      "allow_create_engine": False, "allow_sampling": True, "allow_logprobs": True,
                      "allow_search_indices": False, "allow_view": True, "allow_fine_tuning": False,
                      "organization": "*", "group": None, "is_blocking": False}
        return {"id": model_id, "object": "model", "created": created, "owned_by": "graphinfer", "root": root,
                "parent": parent, "max_model_len": max_model_len, "permission": [permission]}

    # ----- loading and unloading (blocking) -----
    def load_lora_adapter(self, lora_name: str, lora_path: str, base_model_name: str | None = None) -> str:
        """Read and check the adapter in the engine, then serve it under lora_name; APIError 400 as vLLM's (a name
        already loaded, a missing field, an adapter the engine refuses: its LoRAAdapterError's message)."""
        if not lora_name or not lora_path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput")
        with self._lock:
            if lora_name in self.lora_requests:
                raise APIError(400, f"The lora adapter '{lora_name}' has already been loaded.", "InvalidUserInput")
            if lora_name == self.base_model_name:
                raise APIError(400, f"'{lora_name}' is the base model's name; give the adapter another name.",
                               "InvalidUserInput")
            lora = LoRARequest(lora_name, self._last_id + 1, lora_path)
            if base_model_name is not None and base_model_name == self.base_model_name:
                lora.base_model_name = base_model_name
            try:
                self.engine.add_lora(lora)
            except LoRAAdapterError as e:
                raise APIError(400, str(e), "BadRequestError") from None
            self._last_id = lora.lora_int_id
            self.lora_requests[lora_name] = lora
        logger.info("Loaded new LoRA adapter: name '%s', path '%s' (id %d)", lora_name, lora_path, lora.lora_int_id)
        return f"Success: LoRA adapter '{lora_name}' added successfully."

    def unload_lora_adapter(self, lora_name: str) -> str:
        """Stop serving the adapter (requests already running with it finish with it) and free its host copy;
        vLLM's 404 for a name not loaded."""
        if not lora_name:
            raise APIError(400, "'lora_name' needs to be provided to unload a LoRA adapter.", "InvalidUserInput")
        with self._lock:
            lora = self.lora_requests.pop(lora_name, None)
            if lora is None:
                raise APIError(404, f"The lora adapter '{lora_name}' cannot be found.", "NotFoundError")
            self.engine.remove_lora(lora.lora_int_id)
        logger.info("Removed LoRA adapter: name '%s'", lora_name)
        return f"Success: LoRA adapter '{lora_name}' removed successfully."

    def load_static(self, modules: list[LoRAModulePath]) -> None:
        """serve --lora-modules: every adapter loaded now, in order (ids 1, 2, ...); the first refused raises."""
        for module in modules:
            self.load_lora_adapter(module.name, module.path, module.base_model_name)
