"""Tool-call parsers, by the name `--tool-call-parser` takes (one file each)."""

from __future__ import annotations

from cpuinfer.entrypoints.openai.tool_parsers.base import ParsedCall, ParsedOutput, ToolParser
from cpuinfer.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from cpuinfer.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser}

__all__ = ["TOOL_PARSERS", "ParsedCall", "ParsedOutput", "ToolParser"]
