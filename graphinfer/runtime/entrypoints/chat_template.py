"""Chat messages -> prompt token ids through the tokenizer's chat template (LLM.chat and the server)."""
import json

from graphinfer.errors import InvalidRequestError


def _template_messages(messages: list[dict]) -> list[dict]:
    """As vLLM passes them: an assistant message's tool call arguments as a dict, not the JSON text the API
    carries (templates index them and write them with tojson), and no content as "" (an assistant turn with only
    tool calls has none); the caller's dicts are left as they are."""
    out = []
    for i, message in enumerate(messages):
        if isinstance(message, dict) and message.get("role") == "assistant" and \
                isinstance(message.get("tool_calls"), list):
            message = {**message, "tool_calls": [_parsed_arguments(c, i, j) for j, c in enumerate(message["tool_calls"])]}
            if message.get("content") is None:
                message["content"] = ""
        out.append(message)
    return out


def _parsed_arguments(call, i: int, j: int):
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    function = dict(call["function"])
    args = function.get("arguments")
    if not args:
        function["arguments"] = {}
    elif isinstance(args, str):
        try:
            function["arguments"] = json.loads(args)
        except json.JSONDecodeError as e:
            raise InvalidRequestError(f"messages[{i}].tool_calls[{j}].function.arguments is not valid JSON ({e}); "
                                      f"send the arguments as the JSON text the tool call came with.") from None
    return {**call, "function": function}


# apply_chat_template's own arguments, which chat_template_kwargs may not set (vLLM sets them from the request)
_RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                              "add_generation_prompt", "continue_final_message", "padding", "truncation", "max_length",
                              "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def check_chat_template_kwargs(kwargs) -> dict:
    """chat_template_kwargs: a dict of template variables, none of apply_chat_template's own arguments."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object of template variables.")
    if reserved := sorted(set(kwargs) & _RESERVED_KWARGS):
        raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}: they are the request's "
                                  f"own fields (or fixed by the server).")
    return kwargs


def chat_prompt_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                     chat_template: str | None = None, tools: list[dict] | None = None,
                     chat_template_kwargs: dict | None = None) -> str:
    """The messages rendered by the chat template, as text (tokenize it with add_special_tokens=False).
    tools: OpenAI's [{"type": "function", "function": {name, description, parameters}}], for templates that
    render them (Qwen, Llama 3.x); a template without a tools block ignores them. chat_template_kwargs: more
    variables the template reads (vLLM's; e.g. enable_thinking for Qwen3)."""
    if tokenizer is None:
        raise InvalidRequestError("This model ships no tokenizer, so it has no chat template; send token ids "
                                  "to the completions API instead.")
    messages = _template_messages(messages)
    kwargs = check_chat_template_kwargs(chat_template_kwargs)
    try:
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt, chat_template=chat_template,
                                             **kwargs)
    except Exception as e:  # the template is arbitrary Jinja run on the caller's messages: any failure is theirs
        raise InvalidRequestError(f"The messages could not be rendered with the model's chat template: {e}") from None


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None, tools: list[dict] | None = None,
                    chat_template_kwargs: dict | None = None) -> list[int]:
    text = chat_prompt_text(tokenizer, messages, add_generation_prompt, chat_template, tools, chat_template_kwargs)
    return tokenizer(text, add_special_tokens=False).input_ids
