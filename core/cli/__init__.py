"""The `trainrec` command line (`commands`; also `python -m trainrec`), its `check` command (`check`),
`trainrec demo` (`demo`) and how it prints file text (`terminal`). The top of the house: it may import every layer and tool.

`trainrec.cli` is `trainrec.cli.commands`'s names."""


from .commands import (
    main,
)

__all__ = [
    "main",
]
