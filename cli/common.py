"""Shared CLI pieces: one-line errors, backend options, the console."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Annotated

import typer
from pydantic import ValidationError
from rich.console import Console

from ragfix.errors import DataError
from ragfix.models import ModelNotFoundError

console = Console()
err_console = Console(stderr=True)


class UserError(Exception):
    """An error caused by the user's input; printed as one line, exit code 2."""


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn the errors a user can cause into one line on stderr and exit code 2 (no traceback)."""
    try:
        yield
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "options"
        err_console.print(f"[red]error:[/red] {loc}: {first['msg']}", highlight=False)
        raise typer.Exit(2) from None
    except (UserError, DataError, ModelNotFoundError, ValueError, FileNotFoundError) as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        err_console.print(f"[red]error:[/red] {msg}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt:
        err_console.print(
            "interrupted: finished results are saved; rerun the same command to resume"
        )
        sys.exit(130)


def parse_options(pairs: list[str] | None) -> dict:
    """``["key=value", ...]`` to a dict; values parsed as JSON when they can be (numbers, lists).

    Raises:
        UserError: an item without ``=``.
    """
    import json

    out: dict = {}
    for item in pairs or []:
        if "=" not in item:
            raise UserError(f"--backend-opt {item!r}: expected key=value")
        k, v = item.split("=", 1)
        try:
            out[k.strip().replace("-", "_")] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip().replace("-", "_")] = v
    return out


ModelOpt = Annotated[
    str, typer.Option("--model", "-m", help="'smollm2' (embedded), a HF id, a folder or a .gguf")
]
BackendOpt = Annotated[
    str,
    typer.Option("--backend", "-b", help="vanilla, channel-scaled, gali, pos2distill"),
]
BackendOptsOpt = Annotated[
    list[str] | None,
    typer.Option("--backend-opt", help="backend option key=value (repeatable)"),
]
DeviceOpt = Annotated[str, typer.Option(help="auto (CUDA when present), cpu, cuda, cuda:1 ...")]
DtypeOpt = Annotated[str, typer.Option(help="auto (bf16 on CUDA, fp32 on CPU), float16 ...")]
