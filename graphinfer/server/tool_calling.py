"""A chat request's tools, as vLLM's serving_chat treats them.

- "none" (or no tools): the output is content; the tools are still rendered into the prompt.
- "auto": the server's --tool-call-parser reads calls out of the text (--enable-auto-tool-choice must be on).
- "required" / a named function: structured outputs enforce vLLM's JSON schema (an array of {name, parameters}, or
  the function's parameters), and that JSON becomes message.tool_calls.
finish_reason is "tool_calls" where calls were made and the output stopped (not for a named function, as vLLM).
`parallel_tool_calls: false` keeps the first call (for "required" the schema also allows only one).
"""
import copy
from dataclasses import dataclass, replace
from functools import partial
from typing import Callable

from graphinfer.errors import InvalidRequestError
from graphinfer.sampling_params import SamplingParams, StructuredOutputsParams
from graphinfer.server.protocol import ChatCompletionNamedToolChoiceParam, ChatCompletionRequest
from graphinfer.server.tool_parsers import NamedToolParser, RequiredToolParser, ToolParser, ToolParserManager

AUTO_NEEDS_PARSER = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


def _no_parameters() -> dict:  # a function without parameters takes an empty object
    return {"type": "object", "properties": {}}


def tool_choice_json_schema(req: ChatCompletionRequest) -> dict | None:
    """vLLM's schema for "required" (each item one of the tools: name fixed by an enum, parameters by the tool's
    schema; $defs moved to the top, where their references point) or a named function (its parameters)."""
    choice, tools = req.tool_choice, req.tools or []
    if isinstance(choice, ChatCompletionNamedToolChoiceParam):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return tool.function.parameters or _no_parameters()
    if choice != "required":
        return None
    items, defs = [], {}
    for tool in tools:
        params = copy.deepcopy(tool.function.parameters) or _no_parameters()
        tool_defs = params.pop("$defs", {})
        if not isinstance(tool_defs, dict):
            raise InvalidRequestError(f"tool {tool.function.name!r}: parameters.$defs must be an object of schemas.")
        for name, schema in tool_defs.items():
            if defs.get(name, schema) != schema:
                raise InvalidRequestError(f"Tool definition '{name}' has multiple schemas, which is not supported: "
                                          f"tools share one $defs, so give the differing definitions distinct names.")
            defs[name] = schema
        items.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]}, "parameters": params},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


@dataclass
class ToolCalling:
    mode: str  # "auto", "required" or "named"
    make_parser: Callable[[], ToolParser]
    parallel: bool
    schema: dict | None = None

    @classmethod
    def for_request(cls, req: ChatCompletionRequest, tool_parser: str | None) -> "ToolCalling | None":
        """None where the output is plain content. tool_parser: the server's, None without --enable-auto-tool-choice."""
        choice, parallel = req.tool_choice, req.parallel_tool_calls is not False
        if not req.tools or choice in (None, "none"):
            return None
        if choice == "auto":
            if tool_parser is None:
                raise InvalidRequestError(AUTO_NEEDS_PARSER)
            return cls("auto", ToolParserManager.get_tool_parser(tool_parser), parallel)
        schema = tool_choice_json_schema(req)
        if choice == "required":
            return cls("required", RequiredToolParser, parallel, schema)
        return cls("named", partial(NamedToolParser, choice.function.name), parallel, schema)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """params with the structured output that enforces "required" / the named function."""
        if self.schema is None:
            return params
        if params.structured_outputs is not None:
            raise InvalidRequestError(f'tool_choice "{self.mode}" is enforced by structured outputs, so it cannot be '
                                      f"combined with response_format or structured_outputs; drop one of them.")
        return replace(params, structured_outputs=StructuredOutputsParams(json=self.schema))

    def finish_reason(self, finish: str | None, called: bool) -> str | None:
        return "tool_calls" if called and finish == "stop" and self.mode != "named" else finish

    def message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """The response's message for the whole output, and its finish_reason."""
        info = self.make_parser().extract_tool_calls(text)
        message = {"role": "assistant", "content": info.content}
        if info.tools_called:
            calls = info.tool_calls if self.parallel else info.tool_calls[:1]
            message["tool_calls"] = [call.model_dump() for call in calls]
        return message, self.finish_reason(finish, info.tools_called)

    def stream(self) -> "ToolCallStream":
        return ToolCallStream(self, self.make_parser())


class ToolCallStream:
    """One streamed choice: each new piece of text -> the chunk's delta (content and / or tool_calls pieces)."""

    def __init__(self, calling: ToolCalling, parser: ToolParser):
        self.calling, self.parser, self.text = calling, parser, ""

    def delta(self, piece: str, finish: str | None) -> tuple[dict, str | None]:
        previous, self.text = self.text, self.text + piece
        if finish is None:
            d = self.parser.extract_tool_calls_streaming(previous, self.text, piece)
        else:
            d = self.parser.finish_streaming(self.text)
        body = {}
        if d is not None:
            if d.content:
                body["content"] = d.content
            calls = [c.model_dump(exclude_none=True) for c in d.tool_calls if self.calling.parallel or c.index == 0]
            if calls:
                body["tool_calls"] = calls
        return body, self.calling.finish_reason(finish, self.parser.tools_streamed)
