"""vLLM's request fields beyond OpenAI's, as its server takes them (the completions and chat bodies of protocol.py
inherit them), and the fields nobody implements: accepted and logged, once per field name, as vLLM logs the fields it
ignores.

- logit_bias: {"token id": bias}; a key that is not a token id, a bias that is not a finite number or more than
  MAX_LOGIT_BIAS entries are 400s naming the field; biases are clamped to [-100, 100] (vLLM's, OpenAI's range); ids
  outside the vocabulary are refused by the input processor.
- allowed_token_ids, bad_words, truncate_prompt_tokens, spaces_between_special_tokens: SamplingParams' (checked there).
- chat only: chat_template (needs --trust-request-chat-template, as vLLM), chat_template_kwargs (variables the
  template reads, e.g. enable_thinking).
"""
import logging
import threading
from typing import Any

from pydantic import BaseModel, model_validator

from graphinfer.errors import InvalidSamplingParamsError
from graphinfer.sampling_params import LOGIT_BIAS_CLAMP, MAX_LOGIT_BIAS

logger = logging.getLogger(__name__)

_logged_lock = threading.Lock()
_logged: set[str] = set()  # field names already logged (a log's dedupe: the only state here)


def log_ignored_fields(names) -> None:
    """Log each unknown request field's name the first time a request carries it."""
    with _logged_lock:
        new = sorted(n for n in names if n not in _logged)
        _logged.update(new)
    if new:
        logger.warning("The following fields were present in the request but ignored: %s (logged once per name)", new)


class IgnoredFieldsLogged(BaseModel):
    """A request body whose unknown fields are accepted (model_config extra="allow") and logged."""

    @model_validator(mode="after")
    def _log_extra(self):
        if self.model_extra:
            log_ignored_fields(self.model_extra)
        return self


class VllmSamplingFields(BaseModel):
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    spaces_between_special_tokens: bool = True

    def vllm_sampling_kwargs(self) -> dict:
        """SamplingParams' keyword arguments for these fields."""
        return dict(logit_bias=_logit_bias(self.logit_bias), allowed_token_ids=self.allowed_token_ids,
                    bad_words=self.bad_words, truncate_prompt_tokens=self.truncate_prompt_tokens,
                    spaces_between_special_tokens=self.spaces_between_special_tokens)


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    if len(bias) > MAX_LOGIT_BIAS:
        raise InvalidSamplingParamsError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are accepted.")
    out = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidSamplingParamsError(f"logit_bias: {key!r} is not a token id (keys are token ids as "
                                             f"strings, e.g. {{\"1234\": -100}}).") from None
        out[token] = min(LOGIT_BIAS_CLAMP, max(-LOGIT_BIAS_CLAMP, value))
    return out


class ChatTemplateFields(BaseModel):
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
