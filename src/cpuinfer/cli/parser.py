"""The argument parser of every `cpuinfer` command: no silent abbreviations (`--max-num-seq 4` is an error,
not --max-num-seqs), an unknown flag named with the closest known ones, and errors as one short paragraph
that points at --help instead of the whole usage."""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from typing import NoReturn


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The innermost (sub)command parser that `args` went through (`bench serve`'s, not `cpuinfer`'s)."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        chosen = getattr(args, subs[0].dest, None) if subs else None
        if chosen is None:
            return parser
        parser = subs[0].choices[chosen]


class Parser(argparse.ArgumentParser):
    """argparse.ArgumentParser with allow_abbrev=False, "did you mean" hints and short errors."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def known_flags(self) -> list[str]:
        """Every long option string of this parser."""
        return [s for a in self._actions for s in a.option_strings if s.startswith("--")]

    def suggest(self, flag: str) -> list[str]:
        """The known flags closest to `flag` (a typo, or a prefix that is no longer accepted)."""
        name = flag.split("=", 1)[0]
        known = self.known_flags()
        prefixed = [k for k in known if k.startswith(name)] if len(name) > 3 else []
        return (prefixed or difflib.get_close_matches(name, known, n=3, cutoff=0.6))[:3]

    def error(self, message: str) -> NoReturn:
        """Print `prog: error: message`, hints for unknown flags, and where the usage is; exit 2."""
        found = re.search(r"unrecognized arguments: (.*)", message)
        lines = [f"{self.prog}: error: {message}"]
        if found:
            for flag in found.group(1).split():
                if flag.startswith("-"):
                    close = self.suggest(flag)
                    if close:
                        lines.append(f"  {flag}: did you mean {' or '.join(close)}?")
        lines.append(f"See `{self.prog} --help` for the options.")
        sys.stderr.write("\n".join(lines) + "\n")
        sys.exit(2)
