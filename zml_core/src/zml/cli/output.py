"""How the ``zml`` command prints: text (never markup), errors as one message, tables that fit.

Messages carry text that rich would read as markup: a hint such as ``define it under
[policies.NAME]`` loses its brackets when printed as markup. So everything not written here is
printed as :class:`rich.text.Text`, and styles are applied to spans, never parsed from strings.

Errors are printed whole (``soft_wrap``: no line breaks inserted, the terminal wraps), so a
message can be copied and searched for. Table columns that hold ids, URLs and reasons fold
onto several lines instead of being cut with an ellipsis, so at 80 columns every port and id
is still there.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["CommandError", "print_error", "stderr_console", "stdout_console", "table"]


class CommandError(Exception):
    """A user error the command reports in one message with exit status 2 (no traceback).

    For errors that are not zml errors: a busy port, a folder that cannot be written, a bad
    command-line value.
    """


def stdout_console() -> Console:
    """The console for a command's output."""
    return Console(highlight=False)


def stderr_console() -> Console:
    """The console for errors."""
    return Console(stderr=True, highlight=False)


def print_error(console: Console, kind: str, message: str) -> None:
    """Print ``error: KIND: MESSAGE`` as text, unwrapped."""
    line = Text("error: ", style="bold red")
    if kind:
        line.append(f"{kind}: ")
    line.append(message)
    console.print(line, soft_wrap=True)


def table(*columns: str, title: str | None = None, whole: tuple[str, ...] = (),
          **kwargs: Any) -> Table:
    """A table whose cells wrap or fold rather than being cut with an ellipsis.

    The columns named in ``whole`` (ids, URLs) are never wrapped: the others make room.
    """
    t = Table(title=title, **kwargs)
    for name in columns:
        t.add_column(name, overflow="fold", no_wrap=name in whole)
    return t
