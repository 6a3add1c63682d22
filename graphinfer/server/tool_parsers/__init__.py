"""Tool call parsers (vLLM's interface and names): `--tool-call-parser hermes | llama3_json | llama4_json`."""
from graphinfer.server.tool_parsers.abstract_tool_parser import ToolParser, ToolParserManager
from graphinfer.server.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from graphinfer.server.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from graphinfer.server.tool_parsers.structured_tool_parser import NamedToolParser, RequiredToolParser

__all__ = ["ToolParser", "ToolParserManager", "Hermes2ProToolParser", "Llama3JsonToolParser", "NamedToolParser",
           "RequiredToolParser"]
