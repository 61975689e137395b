"""The tool-call parsers, by the name a server flag or `render.TemplateTools.parser` gives."""

from __future__ import annotations

from kvbaton.server.tools.hermes import HermesParser
from kvbaton.server.tools.llama3_json import Llama3JsonParser
from kvbaton.server.tools.parser import ToolParser

TOOL_PARSERS: dict[str, ToolParser] = {parser.name: parser for parser in (HermesParser(), Llama3JsonParser())}


def tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return TOOL_PARSERS[name]
