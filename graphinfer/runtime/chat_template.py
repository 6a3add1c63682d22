"""Chat messages -> prompt token ids through the tokenizer's chat template (LLM.chat and the server)."""
from graphinfer.errors import InvalidRequestError


def chat_prompt_text(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                     chat_template: str | None = None) -> str:
    """The messages rendered by the chat template, as text (tokenize it with add_special_tokens=False)."""
    if tokenizer is None:
        raise InvalidRequestError("This model ships no tokenizer, so it has no chat template; send token ids "
                                  "to the completions API instead.")
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                             chat_template=chat_template)
    except Exception as e:  # the template is arbitrary Jinja run on the caller's messages: any failure is theirs
        raise InvalidRequestError(f"The messages could not be rendered with the model's chat template: {e}") from None


def chat_prompt_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                    chat_template: str | None = None) -> list[int]:
    text = chat_prompt_text(tokenizer, messages, add_generation_prompt, chat_template)
    return tokenizer(text, add_special_tokens=False).input_ids
