"""The ``ragfix`` command (typer). Thin: parse, call the library, print.

Each command group lives in its own module with a ``register(app)`` function.
"""

from __future__ import annotations

import importlib
import os
from typing import Annotated

import typer

from ragfix.cli.common import RagfixGroup

app = typer.Typer(
    name="ragfix",
    cls=RagfixGroup,
    help="Fix position bias (lost in the middle) in retrieval-augmented generation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    rich_markup_mode="markdown",
)

#: command modules, each with ``register(app)``
COMMAND_MODULES = [
    "ragfix.cli.calibrate_cmd",
    "ragfix.cli.eval_cmd",
    "ragfix.cli.eval_pipeline_cmd",
    "ragfix.cli.report_cmd",
    "ragfix.cli.distill_cmd",
    "ragfix.cli.ppl_cmd",
    "ragfix.cli.judge_cmd",
    "ragfix.cli.bench_cmd",
    "ragfix.cli.tune_cmd",
    "ragfix.cli.serve_cmd",
    "ragfix.cli.merge_cmd",
    "ragfix.cli.export_cmd",
]


@app.callback()
def _global(
    threads: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="torch CPU threads for the model (default: $RAGFIX_THREADS, else the cores the "
            "machine's load leaves free: a busy machine gets fewer threads instead of thrashing)",
        ),
    ] = None,
) -> None:
    """Fix position bias (lost in the middle) in retrieval-augmented generation."""
    if threads is not None:
        from ragfix.models.device import THREADS_ENV

        os.environ[THREADS_ENV] = str(threads)


for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    """Entry point of the ``ragfix`` console script. The Hugging Face libraries' own progress
    bars (weights loading, file downloads) are off unless ``HF_HUB_DISABLE_PROGRESS_BARS`` is set:
    ragfix shows one progress bar per long step itself."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    app()


if __name__ == "__main__":
    main()
