"""The terminal: every console turnrl makes prints text, never markup.

Paths, run names, spec titles, metric names, model replies and error messages that quote a config all
reach the terminal. With rich's markup on, ``[/]`` in a path is a ``MarkupError`` (after the run's first
row, or inside the one-line error itself) and ``[red]`` in a name restyles the line; escaping each
interpolation is a rule somebody forgets. So no console of turnrl's parses markup (:func:`make_console`),
and the few styled words are given as styles (:func:`styled`), never inline.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.text import Text


def make_console(**kwargs: Any) -> Console:
    """A rich console with markup off (every string printed through it is shown as it is)."""
    return Console(markup=False, **kwargs)


def styled(*parts: str | tuple[str, str]) -> Text:
    """Text from plain strings and ``(text, style)`` pairs, e.g. ``styled(("error:", "bold red"), " ", msg)``."""
    return Text.assemble(*parts)
