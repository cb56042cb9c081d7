"""``ragfix merge``: join the job shards of one run (``--shard i/N``) into one run folder."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ragfix.cli.common import console, user_errors


def register(app: typer.Typer) -> None:
    """Add ``merge`` to the CLI."""

    @app.command("merge")
    def merge_cmd(
        out: Annotated[Path, typer.Argument(help="the merged run folder (may be a shard's)")],
        shards: Annotated[
            list[Path],
            typer.Argument(help="the shards' run folders (one folder may hold every shard)"),
        ],
    ) -> None:
        """Join the shards of one run (ragfix eval / eval-pipeline / judge / ppl --shard I/N):
        checks that they ran one configuration (settings, weights, inputs) and hold every cell,
        then writes OUT; the same command without --shard over OUT writes the summary (it loads
        the model to check the identity and computes nothing)."""
        from ragfix.eval.merge import merge_runs

        with user_errors():
            merged = merge_runs(out, shards)
        console.print(
            f"merged {merged['shards']} shards from {len(merged['folders'])} folder(s): "
            f"{merged['cells']} cells in {out}; run the same command without --shard and with "
            f"--out {out} to write its summary",
            highlight=False,
            soft_wrap=True,
        )
