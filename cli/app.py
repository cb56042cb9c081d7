"""The ``ragfix`` command (typer). Thin: parse, call the library, print.

Each command group lives in its own module with a ``register(app)`` function.
"""

from __future__ import annotations

import importlib

import typer

app = typer.Typer(
    name="ragfix",
    help="Fix position bias (lost in the middle) in retrieval-augmented generation.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

#: command modules, each with ``register(app)``
COMMAND_MODULES = [
    "ragfix.cli.calibrate_cmd",
    "ragfix.cli.eval_cmd",
    "ragfix.cli.report_cmd",
    "ragfix.cli.distill_cmd",
    "ragfix.cli.ppl_cmd",
    "ragfix.cli.judge_cmd",
    "ragfix.cli.serve_cmd",
]

for _name in COMMAND_MODULES:
    importlib.import_module(_name).register(app)


def main() -> None:
    """Entry point of the ``ragfix`` console script."""
    app()


if __name__ == "__main__":
    main()
