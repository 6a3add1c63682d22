"""vLLM's ToolParser interface: a model's text -> tool calls, whole (extract_tool_calls) or streamed
(extract_tool_calls_streaming), and ToolParserManager, the registry `--tool-call-parser NAME` picks from.

The parsers here describe a text by `parse(text, final)`: the content outside the calls and each call's name and
arguments as far as they are certain (partial_json). Streaming re-parses the text so far and sends what is new
since the last delta, so the pieces of a stream add up to exactly what the one-shot parse of the whole text gives,
however the text was split.
"""
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

from graphinfer.server.protocol import (DeltaFunctionCall, DeltaMessage, DeltaToolCall, ExtractedToolCallInformation,
                                        FunctionCall, ToolCall, make_tool_call_id)
from graphinfer.server.tool_parsers.partial_json import MalformedJSON, Node, canonical


@dataclass
class PartialCall:
    name: str | None  # None until the name's string is complete
    arguments: str  # the certain prefix of the arguments' JSON text
    complete: bool = False


@dataclass
class ParsedText:
    content: str = ""  # the content so far (text that could still begin a call is held back until final)
    calls: list[PartialCall] = field(default_factory=list)


def call_from_object(node: Node, args_keys: tuple[str, ...]) -> PartialCall:
    """{"name": ..., "arguments": {...}} (or another key in args_keys) read as far as it goes."""
    if node.kind != "object":
        raise MalformedJSON("a tool call must be a JSON object")
    name = node.get("name")
    if name is not None and name.complete and name.kind != "string":
        raise MalformedJSON("a tool call's name must be a string")
    args = next((v for k in args_keys if (v := node.get(k)) is not None), None)
    if node.complete and (name is None or args is None):
        raise MalformedJSON(f"a tool call needs 'name' and one of {args_keys}")
    return PartialCall(name.value if name is not None and name.complete else None, canonical(args), node.complete)


class ToolParser(ABC):
    """One instance per streamed choice (it remembers what was sent); extract_tool_calls keeps no state."""

    def __init__(self, tokenizer=None):
        self.model_tokenizer = tokenizer
        self.current_tool_id = -1  # the index of the last call begun in the stream
        self.streamed_args_for_tool: list[str] = []  # argument text sent per call
        self._ids: list[str] = []
        self._sent_content = ""

    # ----- what a parser defines -----
    @abstractmethod
    def parse(self, text: str, final: bool) -> ParsedText:
        """The content and calls of `text`; final: the text is complete (nothing held back, every call must be
        complete). Raises MalformedJSON where the calls are not valid JSON."""

    # ----- vLLM's interface -----
    def adjust_request(self, request):
        return request

    def extract_tool_calls(self, model_output: str, request=None) -> ExtractedToolCallInformation:
        """The calls in a complete output; malformed calls leave the whole output as content. An output that ends
        inside a call (max_tokens, EOS) gives its calls as far as they are certain, as OpenAI does and as a stream
        sends them (finish_streaming)."""
        parsed = self._parse_final(model_output)
        if parsed is None or not parsed.calls:
            return ExtractedToolCallInformation(tools_called=False, tool_calls=[], content=model_output)
        return ExtractedToolCallInformation(
            tools_called=True, content=parsed.content or None,
            tool_calls=[ToolCall(function=FunctionCall(name=c.name, arguments=c.arguments)) for c in parsed.calls])

    def extract_tool_calls_streaming(self, previous_text: str, current_text: str, delta_text: str,
                                     previous_token_ids: Sequence[int] = (), current_token_ids: Sequence[int] = (),
                                     delta_token_ids: Sequence[int] = (), request=None) -> DeltaMessage | None:
        """What is new in current_text, or None (nothing to send yet, or the calls are malformed)."""
        try:
            return self._delta(self.parse(current_text, final=False))
        except MalformedJSON:
            return None

    def finish_streaming(self, current_text: str) -> DeltaMessage | None:
        """At the end of the output: the rest (held-back text; the whole output as content where the calls turned
        out malformed and no call was sent)."""
        parsed = self._parse_final(current_text)
        if parsed is None:
            parsed = ParsedText(content=current_text) if not self._ids else None
        return self._delta(parsed) if parsed is not None else None

    def _parse_final(self, text: str) -> ParsedText | None:
        """The complete text's parse; where it ends inside a call (a valid beginning of one: the parse of an
        unfinished text succeeds), its calls as far as they go (those whose name is known); None where it is
        malformed or no call's name is known yet."""
        try:
            return self.parse(text, final=True)
        except MalformedJSON:
            pass
        try:
            parsed = self.parse(text, final=False)
        except MalformedJSON:
            return None
        parsed.calls = [c for c in parsed.calls if c.name is not None]
        return parsed if parsed.calls else None  # no call begun: the whole text is content

    @property
    def tools_streamed(self) -> bool:
        return bool(self._ids)

    def _delta(self, parsed: ParsedText) -> DeltaMessage | None:
        content = None
        if parsed.content.startswith(self._sent_content) and len(parsed.content) > len(self._sent_content):
            content = parsed.content[len(self._sent_content):]
            self._sent_content = parsed.content
        pieces = []
        for i, call in enumerate(parsed.calls):
            if i == len(self._ids):  # not begun in the stream: it begins once its name is known
                if call.name is None:
                    break
                self._ids.append(make_tool_call_id())
                self.streamed_args_for_tool.append(call.arguments)
                self.current_tool_id = i
                pieces.append(DeltaToolCall(index=i, id=self._ids[i], type="function",
                                            function=DeltaFunctionCall(name=call.name, arguments=call.arguments)))
                continue
            sent = self.streamed_args_for_tool[i]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                pieces.append(DeltaToolCall(index=i, function=DeltaFunctionCall(arguments=call.arguments[len(sent):])))
                self.streamed_args_for_tool[i] = call.arguments
        if content is None and not pieces:
            return None
        return DeltaMessage(content=content, tool_calls=pieces)


class ToolParserManager:
    """Tool parsers by name (vLLM's registry): `@ToolParserManager.register_module("name")`."""
    tool_parsers: dict[str, type] = {}

    @classmethod
    def register_module(cls, name: str | list[str]):
        def register(parser_cls: type) -> type:
            for n in [name] if isinstance(name, str) else name:
                cls.tool_parsers[n] = parser_cls
            return parser_cls
        return register

    @classmethod
    def get_tool_parser(cls, name: str) -> type:
        from graphinfer.errors import InvalidConfigError

        if name not in cls.tool_parsers:
            raise InvalidConfigError(f"unknown tool call parser {name!r}; pick one of {sorted(cls.tool_parsers)} "
                                     f"(--tool-call-parser).")
        return cls.tool_parsers[name]
