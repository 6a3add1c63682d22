"""What the server refuses in a request body before any work, and the messages that say why (each a 4xx naming the
limit and, where there is one, its flag). The engine's own budgets (--max-logprobs, --max-logprob-entries, the
structured-output compile time-out and slots) are checked by the input processor and the structured-output manager;
the body's size by the Gate (--max-request-body-bytes).
"""
from graphinfer.errors import InvalidRequestError


def body_error_message(cause: BaseException | None) -> str:
    """The 400's message for a body FastAPI could not parse (its own message says only "error parsing the body")."""
    if isinstance(cause, RecursionError):  # Python's json reader: arrays / objects nested ~1,000 deep
        return ("The request body nests JSON arrays / objects too deeply for the server's JSON reader (about 1,000 "
                "levels at most); send a flatter body.")
    if isinstance(cause, UnicodeDecodeError):
        return "The request body could not be read: send JSON encoded as UTF-8."
    detail = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
    return f"The request body could not be read as JSON{detail}; send a JSON object encoded as UTF-8."


def check_chat_template(chat_template: str | None, trusted: bool) -> None:
    """vLLM's rule: a request's own chat_template (Jinja run on the server) only with --trust-request-chat-template."""
    if chat_template is not None and not trusted:
        raise InvalidRequestError(
            "chat_template: this server does not render chat templates sent with a request (start it with "
            "--trust-request-chat-template to allow them); leave chat_template out to use the model's, and pass "
            "template variables in chat_template_kwargs.")
