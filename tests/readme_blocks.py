"""The fenced code blocks of the project's Markdown docs, and the shell commands in them.

Used by ``tests/test_readme.py`` (which command is checked how) and by the scenario driver
``tests/programs/readme_scenario.py`` (which runs them). Standard library only.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ROOT", "Block", "Command", "commands", "read_blocks", "servewatch_argvs"]

ROOT = Path(__file__).resolve().parent.parent

_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)\s*$")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")


@dataclass(frozen=True, slots=True)
class Block:
    """One fenced code block.

    Attributes:
        doc: the file, relative to the repository root (``README.md``).
        lang: the fence's language (``bash``, ``python``, ``toml``; ``""`` for output samples).
        text: the block's lines, newline-terminated.
        line: 1-based line number of the opening fence.
        heading: the nearest heading above it (without the ``#``).
    """

    doc: str
    lang: str
    text: str
    line: int
    heading: str


@dataclass(frozen=True, slots=True)
class Command:
    """One logical shell command line of a ``bash`` block.

    Attributes:
        block: the block it is in.
        text: the line as a shell runs it (continuations joined, comment kept).
        line: 1-based line number in the doc where it starts.
    """

    block: Block
    text: str
    line: int

    @property
    def bare(self) -> str:
        """The command without its trailing comment and surplus spaces (how tests name it)."""
        return " ".join(shlex.split(self.text, comments=True)) if self.text.strip() else ""

    def where(self) -> str:
        return f"{self.block.doc}:{self.line}"


def read_blocks(doc: str) -> list[Block]:
    """Every fenced block of ``ROOT / doc``, in order."""
    blocks: list[Block] = []
    heading = ""
    lang: str | None = None
    start = 0
    body: list[str] = []
    for number, line in enumerate((ROOT / doc).read_text(encoding="utf-8").splitlines(), 1):
        fence = _FENCE.match(line)
        if lang is None:
            if fence:
                lang, start, body = fence.group(1), number, []
            elif m := _HEADING.match(line):
                heading = m.group(2).strip()
            continue
        if line.strip() == "```":
            blocks.append(Block(doc, lang, "".join(body), start, heading))
            lang = None
            continue
        body.append(line + "\n")
    return blocks


def commands(block: Block) -> list[Command]:
    """The logical command lines of a ``bash`` block: a line ending in ``\\`` continues on the
    next; lines that are only a comment are left out."""
    out: list[Command] = []
    pending = ""
    first = 0
    for offset, line in enumerate(block.text.splitlines(), 1):
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if not pending:
            first = block.line + offset
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        out.append(Command(block, pending + line, first))
        pending = ""
    if pending:
        out.append(Command(block, pending, first))
    return out


def servewatch_argvs(command: Command) -> list[list[str]]:
    """The ``servewatch`` invocations of one command line, as argv lists (``[--json]``, an
    optional flag in the docs' notation, gives one argv with it and one without)."""
    text = command.text
    variants = [text]
    if m := re.search(r"\s\[(--[a-z-]+)\]", text):
        variants = [text.replace(m.group(0), ""), text.replace(m.group(0), " " + m.group(1))]
    argvs: list[list[str]] = []
    for variant in variants:
        lexer = shlex.shlex(variant, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        for token in [*lexer, ";"]:
            if token in (";", "&", "&&", "|", "||"):
                if current and current[0] == "servewatch":
                    argvs.append(current)
                current = []
            else:
                current.append(token)
    return argvs
