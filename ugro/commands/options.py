"""A command whose options are declared as data: the fields of one dataclass, each annotated with its
``typer.Option`` and holding its default. typer parses them as it parses a function's parameters; the command
gets them as one value of the dataclass (``ugro slurm-script``, ``ugro k8s-manifest``: a dozen options or more)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, TypeVar, get_type_hints

T = TypeVar("T")


def command(options: type[T], run: Callable[[T], None]) -> Callable[..., None]:
    """A typer command with the options of the dataclass ``options``, in its fields' order; it calls ``run`` with
    them. Its name and help are ``run``'s."""
    hints = get_type_hints(options, include_extras=True)
    parameters = [
        inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name])
        for f in dataclasses.fields(options)  # type: ignore[arg-type]
    ]

    def parsed(**values: Any) -> None:
        run(options(**values))

    parsed.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]
    parsed.__name__ = run.__name__
    parsed.__doc__ = run.__doc__
    return parsed
