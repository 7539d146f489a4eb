"""What the command line prints: text from files and paths as one inert line."""

from __future__ import annotations

__all__ = ["printable"]


def printable(text: str) -> str:
    """`text` with every non-printable character escaped as Python writes it (`\x1b`,
    `\r`, `\n`, `\u202e`, a lone surrogate of an undecodable file name): what comes
    from a file or a path prints as one inert line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode("ascii")
                   for c in text)
