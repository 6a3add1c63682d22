"""Request bodies of the OpenAI API as vLLM serves it (pydantic; unknown fields are accepted and logged once per name:
request_fields.py, with vLLM's own fields beyond OpenAI's).

Validated as vLLM validates them: a failure here is a 400 with OpenAI's error body (BadRequestError).
The checks that need the prompt's token count (max_tokens + prompt within max_model_len) are the server's.
"""
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from graphinfer.sampling_params import SamplingParams
from graphinfer.server.request_fields import ChatTemplateFields, IgnoredFieldsLogged, VllmSamplingFields
from graphinfer.server.structured_outputs import StructuredOutputsFields


def _check_utf8(value) -> None:
    """JSON may carry lone surrogates ("\\ud800"), which no tokenizer or UTF-8 encoder accepts."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("strings must be valid Unicode (no lone surrogates)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_utf8(k)
            _check_utf8(v)
    elif isinstance(value, list):
        for v in value:
            _check_utf8(v)


class _UnicodeChecked(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        _check_utf8(data)
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingRequest(StructuredOutputsFields, VllmSamplingFields, IgnoredFieldsLogged, _UnicodeChecked):
    # + structured_outputs, guided_*, response_format; logit_bias, allowed_token_ids, bad_words, ...
    # NaN / Infinity (Python's json reads them) slip through SamplingParams' range checks and poison sampling.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM extension
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = Field(1, ge=1, le=128)  # OpenAI's range
    stream: bool = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    prompt_logprobs: int | None = None  # vLLM extension: the response's prompt_logprobs (-1: the whole vocabulary)
    return_tokens_as_token_ids: bool | None = None  # vLLM extension: logprobs' tokens as "token_id:<id>"

    @model_validator(mode="before")
    @classmethod
    def _stream_options_need_stream(cls, data):
        # vLLM: "Stream options can only be defined when `stream=True`." (an empty or null one passes)
        if isinstance(data, dict) and data.get("stream_options") and not data.get("stream"):
            raise ValueError("stream_options can only be given when stream=true.")
        return data

    @model_validator(mode="before")
    @classmethod
    def _check_prompt_logprobs(cls, data):
        # vLLM's checks and messages
        if isinstance(data, dict) and isinstance(plp := data.get("prompt_logprobs"), int) and \
                not isinstance(plp, bool):
            if data.get("stream") and (plp > 0 or plp == -1):
                raise ValueError("`prompt_logprobs` are not available when `stream=True`.")
            if plp < -1:
                raise ValueError("`prompt_logprobs` must be a positive value or -1.")
        return data

    def _max_tokens(self) -> int | None:
        return self.max_tokens

    def _logprobs(self) -> int | None:
        return None

    def _prompt_logprobs(self) -> int | None:
        return self.prompt_logprobs

    def _best_of(self) -> int | None:
        return None

    def to_sampling_params(self) -> SamplingParams:
        """Raises InvalidSamplingParamsError (-> 400) for out-of-range values."""
        def pick(value, default):
            return default if value is None else value

        return SamplingParams(
            n=self.n, best_of=self._best_of(), temperature=pick(self.temperature, 1.0), top_p=pick(self.top_p, 1.0), top_k=pick(self.top_k, 0),
            min_p=pick(self.min_p, 0.0), presence_penalty=pick(self.presence_penalty, 0.0),
            frequency_penalty=pick(self.frequency_penalty, 0.0), repetition_penalty=pick(self.repetition_penalty, 1.0),
            seed=self.seed, max_tokens=self._max_tokens(), min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=self._logprobs(),
            prompt_logprobs=self._prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens, include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.structured_outputs_params(), **self.vllm_sampling_kwargs())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs (input_processor.py)
    echo: bool = False  # the prompt's text before each choice's
    best_of: int | None = Field(None, ge=1, le=20)  # OpenAI's range; None: n
    suffix: None = None  # insertion is not supported

    @model_validator(mode="after")
    def _parallel_sampling(self):
        if self.best_of is not None and self.best_of > self.n and self.stream:
            raise ValueError(f"best_of={self.best_of} > n={self.n} cannot be streamed (as in OpenAI's API: the best "
                             f"are known only once all candidates finished); set stream=false, or best_of=n.")
        return self

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _best_of(self) -> int | None:
        return self.best_of

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0 (OpenAI's, vLLM's): the prompt scored, nothing generated (the engine samples one
        token, which the response leaves out)."""
        return self.echo and self.max_tokens == 0

    def _max_tokens(self) -> int | None:
        return 1 if self.echo_only else self.max_tokens

    def _prompt_logprobs(self) -> int | None:
        # echo with logprobs: the prompt's tokens come back with theirs (vLLM's rule)
        if self.prompt_logprobs is None and self.echo:
            return self.logprobs
        return self.prompt_logprobs

    def prompts(self) -> list:
        """A single prompt or a batch, each a string or token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)) or not p:
            return [p]
        return list(p)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: str


# ----- tools, named as in vLLM's protocol -----

class FunctionDefinition(BaseModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema


class ChatCompletionToolsParam(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(BaseModel):
    name: str


class ChatCompletionNamedToolChoiceParam(BaseModel):
    function: ChatCompletionNamedFunction
    type: Literal["function"] = "function"


def make_tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON, as a string


class ToolCall(BaseModel):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    """One piece of a streamed tool call: the first carries id, type and name, later ones argument text."""
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(BaseModel):
    content: str | None = None
    tool_calls: list[DeltaToolCall] = Field(default_factory=list)


class ExtractedToolCallInformation(BaseModel):
    tools_called: bool
    tool_calls: list[ToolCall]
    content: str | None = None  # the text outside the calls (None: none)


class MessageFunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] | None = None  # OpenAI sends a JSON string; some clients a dict


class MessageToolCall(BaseModel):
    """A tool call in an assistant message sent back in the conversation."""
    id: str | None = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]  # OpenAI's roles
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None
    function_call: Any | None = None

    @model_validator(mode="after")
    def _content_required(self):
        # OpenAI: content is required, except on an assistant message that carries tool_calls / function_call
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.function_call)):
            raise ValueError(f"a '{self.role}' message needs 'content' (a string or a list of text parts)"
                             + ("; an assistant message may leave it out only with tool_calls" if self.role == "assistant"
                                else ""))
        return self

    def to_template(self) -> dict:
        """The message as chat templates read it (vLLM's: name, an assistant's tool_calls, a tool's tool_call_id;
        runtime/chat_template.py turns the calls' arguments into dicts)."""
        content = self.content if isinstance(self.content, str) or self.content is None else \
            "".join(part.text for part in self.content)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        if self.role == "assistant" and self.tool_calls:
            message["tool_calls"] = [call.model_dump(exclude_none=True) for call in self.tool_calls]
        if self.role == "tool" and self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class ChatCompletionRequest(ChatTemplateFields, _SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs
    add_generation_prompt: bool = True
    tools: list[ChatCompletionToolsParam] | None = None
    tool_choice: Literal["none", "auto", "required"] | ChatCompletionNamedToolChoiceParam | None = "none"
    parallel_tool_calls: bool | None = True

    @model_validator(mode="before")
    @classmethod
    def check_tool_usage(cls, data):
        """vLLM's checks and messages. Tools without tool_choice mean "auto"."""
        if not isinstance(data, dict):
            return data
        if data.get("tools") == []:
            raise ValueError("`tools` must not be an empty array. Either provide at least one tool or omit the "
                             "field entirely.")
        if "tool_choice" not in data and data.get("tools"):
            data["tool_choice"] = "auto"
        choice = data.get("tool_choice")
        if choice is None or choice == "none":
            return data
        if data.get("tools") is None:
            raise ValueError("When using `tool_choice`, `tools` must be set.")
        if choice not in ("auto", "required") and not isinstance(choice, dict):
            raise ValueError(f'Invalid value for `tool_choice`: {choice}! Only named tools, "none", "auto" or '
                             f'"required" are supported.')
        if isinstance(choice, dict):
            usage = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
            function = choice.get("function")
            if not isinstance(function, dict):
                raise ValueError(f"Invalid value for `function`: `{function}` in `tool_choice`! {usage}")
            if "name" not in function:
                raise ValueError(f"Expected field `name` in `function` in `tool_choice`! {usage}")
            if not isinstance(function["name"], str) or not function["name"]:
                raise ValueError(f"Invalid `name` in `function`: `{function['name']}` in `tool_choice`! {usage}")
        return data

    @model_validator(mode="after")
    def _named_tool_among_tools(self):
        if isinstance(self.tool_choice, ChatCompletionNamedToolChoiceParam) and \
                self.tool_choice.function.name not in {t.function.name for t in self.tools or []}:
            raise ValueError("The tool specified in `tool_choice` does not match any of the specified `tools`")
        return self

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        # vLLM: "when using `top_logprobs`, `logprobs` must be set to true." (top_logprobs=0 passes, as there)
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true.")
        return self

    def _max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_UnicodeChecked):
    """vLLM's /tokenize body: a `prompt` (TokenizeCompletionRequest) or chat `messages` (TokenizeChatRequest)."""
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatCompletionToolsParam] | None = None  # rendered with the messages, as a chat request would
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template adds them)
    add_generation_prompt: bool = True
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _prompt_or_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of 'prompt' (a string) or 'messages' (a chat).")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


class LoadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/load_lora_adapter body (serving_models.py checks that both are given)."""
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_path: str = ""


class UnloadLoRAAdapterRequest(BaseModel):
    """vLLM's /v1/unload_lora_adapter body (lora_int_id accepted as vLLM's, the adapter found by its name)."""
    model_config = ConfigDict(extra="ignore")
    lora_name: str = ""
    lora_int_id: int | None = None
