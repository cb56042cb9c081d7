"""Shared CLI pieces: one-line errors, backend options, option groups, the console."""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import click
import typer
from pydantic import ValidationError
from rich.console import Console
from typer.core import TyperGroup

from ragfix.errors import ConfigError, RagfixError

console = Console()
err_console = Console(stderr=True)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn a user's mistake into one line on stderr (``error: ...``) and exit code 2.

    Only :class:`ragfix.errors.RagfixError` (a bad file, setting, model or adapter) and
    pydantic's ``ValidationError`` (invalid settings or backend options) are a user's mistake;
    every other exception is a bug and propagates with its traceback. Ctrl-C exits with 130,
    saying what was kept (an :class:`~ragfix.errors.Interrupted`'s message).
    """
    try:
        yield
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "options"
        err_console.print(f"[red]error:[/red] {loc}: {first['msg']}", highlight=False)
        raise typer.Exit(2) from None
    except RagfixError as e:
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        err_console.print(f"[red]error:[/red] {msg}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None
    except KeyboardInterrupt as e:
        kept = str(e).strip() or "finished results are saved"
        err_console.print(
            f"interrupted: {kept}; rerun the same command to resume",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(130)


def parse_options(pairs: list[str] | None) -> dict:
    """``["key=value", ...]`` to a dict; values parsed as JSON when they can be (numbers, lists).

    Raises:
        ConfigError: an item without ``=``.
    """
    import json

    out: dict = {}
    for item in pairs or []:
        if "=" not in item:
            raise ConfigError(f"--backend-opt {item!r}: expected key=value")
        k, v = item.split("=", 1)
        try:
            out[k.strip().replace("-", "_")] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip().replace("-", "_")] = v
    return out


def backend_options(
    opts: list[str] | None, calibration: Path | None, train_window: int | None
) -> dict:
    """Merge ``--backend-opt key=value`` with the convenience flags of the method backends."""
    out = parse_options(opts)
    if calibration is not None:
        out["calibration"] = str(calibration)
    if train_window is not None:
        out["train_window"] = train_window
    return out


def parse_numbers(text: str | None, flag: str, kind: type = float) -> list | None:
    """``"0.5,1,2"`` to ``[0.5, 1.0, 2.0]`` (``kind`` ``int``: whole numbers only; ``None``
    stays ``None``; empty items are ignored).

    Raises:
        ConfigError: an item that is not a number of that kind (the message names ``flag``).
    """
    if text is None:
        return None
    try:
        return [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        what = "whole numbers" if kind is int else "numbers"
        raise ConfigError(f"{flag} {text!r}: expected {what} separated by commas") from None


def backend_help() -> tuple[str, str]:
    """``--backend``'s help (the registered names) and the list of the registered backends with
    their summaries (Markdown, the epilog of a command that takes ``--backend``), read from the
    registry (``ragfix.backends`` imports neither torch nor a method)."""
    from ragfix.backends import backend_names, backend_spec

    names = backend_names()
    listing = "\n".join(
        f"* {n}" + (f": {backend_spec(n).summary}" if backend_spec(n).summary else "")
        for n in names
    )
    return f"one of: {', '.join(names)}", f"**Backends** (--backend):\n\n{listing}"


class RagfixGroup(TyperGroup):
    """The ``ragfix`` command group: the help of a command's ``--backend`` option and the list of
    backends after its help are read from the backend registry when the command is resolved (a
    backend registered after the CLI was imported is listed too)."""

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        """The command ``cmd_name``, with :func:`backend_help` when it takes ``--backend``."""
        cmd = super().get_command(ctx, cmd_name)
        for param in getattr(cmd, "params", ()):
            if "--backend" in param.opts:
                param.help, cmd.epilog = backend_help()
        return cmd


ModelOpt = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="'smollm2' (embedded), a HF id, a folder, a .gguf, or openai:NAME (a served model, "
        "with --api-base)",
    ),
]
BackendOpt = Annotated[
    str, typer.Option("--backend", "-b", help="a registered backend (listed by --help)")
]
BackendOptsOpt = Annotated[
    list[str] | None,
    typer.Option("--backend-opt", help="backend option key=value (repeatable)"),
]
CalibrationOpt = Annotated[Path | None, typer.Option(help="channel-scaled: calibration JSON")]
AdapterOpt = Annotated[
    Path | None,
    typer.Option(help="LoRA adapter folder (any backend; pos2distill needs one)"),
]
TrainWindowOpt = Annotated[
    int | None, typer.Option(help="gali: the model's trained window L (override)")
]
DeviceOpt = Annotated[str, typer.Option(help="auto (CUDA when present), cpu, cuda, cuda:1 ...")]


def _dtype_option(value: str) -> str:
    """``--dtype``'s callback: a dtype name :func:`~ragfix.models.device.check_dtype` accepts,
    or exit 2 with one line naming the valid ones."""
    from ragfix.models.device import check_dtype

    with user_errors():
        return check_dtype(value)


DtypeOpt = Annotated[
    str,
    typer.Option(
        help="auto (bf16 on CUDA, fp32 on CPU), float32, bfloat16 or float16",
        callback=_dtype_option,
    ),
]
RestartOpt = Annotated[
    bool,
    typer.Option(
        "--restart",
        help="start the run folder over when it holds a run of other settings, weights or "
        "inputs (otherwise refused)",
    ),
]
RunFolderOpt = Annotated[Path, typer.Option("--out", "-o", help="run folder (resumable)")]
PositionsOpt = Annotated[str, typer.Option(help="all | first,middle,last | 0,4,9")]
RanksOpt = Annotated[
    str,
    typer.Option(
        "--positions",
        help="gold retrieval ranks: all | first,middle,last | 0,4,9 | natural (each question "
        "only where the retriever ranked its gold chunk: the end-to-end accuracy)",
    ),
]
TaskOpt = Annotated[
    str | None,
    typer.Option(
        help="the task the records are read as: QA files qa (Lost in the Middle's prompt, the "
        "default), qa-extractive (short extractive answers), qa-extractive-2shot (the same with "
        "two demonstrations); KV files kv (--repeat reads it twice)"
    ),
]
QaTaskOpt = Annotated[
    str,
    typer.Option(
        "--task",
        help="the QA task every pipeline renders and scores: qa (Lost in the Middle's prompt), "
        "qa-extractive (short extractive answers), qa-extractive-2shot (the same with two "
        "demonstrations)",
    ),
]
RepeatOpt = Annotated[
    str,
    typer.Option(
        help="read the passages (passages: JRT-Prompt) or the whole prompt (prompt) twice, a "
        "prompt-level correction for the plain model, an adapter or a served model: none | "
        "passages | prompt"
    ),
]
ReferencesOpt = Annotated[
    bool | None,
    typer.Option(
        "--references/--no-references",
        help="also run each sample closed-book (no passage) and oracle (the gold alone), "
        "reported before the curve (default: on for QA, off for KV)",
        show_default=False,
    ),
]
LimitOpt = Annotated[int | None, typer.Option(help="use the first N samples")]
RecordsOpt = Annotated[
    str | None,
    typer.Option(
        help="record range START:END of the data (or question) file (0-based, END excluded; "
        "record i is line i+1), before --limit; kept in config.json"
    ),
]
SkipInvalidOpt = Annotated[
    bool, typer.Option(help="skip and count malformed records instead of stopping")
]
LogPromptsOpt = Annotated[
    bool,
    typer.Option(
        help="keep in results.jsonl the prompt each cell's model read (shown by ragfix "
        "report --html); --no-log-prompts leaves them out of a very large run. A folder "
        "keeps the setting it was started with"
    ),
]
ApiBaseOpt = Annotated[
    str | None,
    typer.Option(
        help="openai:NAME models: the server's base URL, e.g. http://127.0.0.1:8000/v1 "
        "(API key from $OPENAI_API_KEY)"
    ),
]
TokenizerOpt = Annotated[
    str | None,
    typer.Option(
        help="openai:NAME models: local name of the same model whose tokenizer counts and "
        "formats prompts (default: the server's usage figures count)"
    ),
]
ContextWindowOpt = Annotated[
    int | None,
    typer.Option(help="openai:NAME models: the server's window (default: what /v1/models says)"),
]
ConcurrencyOpt = Annotated[
    int | None, typer.Option(help="openai:NAME models: requests in flight at once (default 4)")
]
MaxRetriesOpt = Annotated[
    int | None,
    typer.Option(
        help="openai:NAME models: retries on 429, 5xx, timeouts, with backoff (default 5)"
    ),
]
TimeoutOpt = Annotated[
    float | None, typer.Option(help="openai:NAME models: seconds per request (default 120)")
]


def remote_options(model: str, flags: dict) -> dict:
    """The remote-model flags that were given (``flags``: the values of :data:`REMOTE_OPTIONS`),
    as backend options (:class:`~ragfix.backends.remote.RemoteOptions`).

    Raises:
        ConfigError: a remote flag with a local model, or ``openai:NAME`` without ``--api-base``.
    """
    from ragfix.models.resolve import REMOTE_PREFIX

    given = {k: v for k, v in flags.items() if v is not None}
    if not model.startswith(REMOTE_PREFIX):
        if given:
            flag = "--" + next(iter(given)).replace("_", "-")
            raise ConfigError(f"{flag} is for a served model: use --model openai:NAME")
        return {}
    if "api_base" not in given:
        raise ConfigError(f"--model {model} needs --api-base URL (the server's base URL)")
    return given


#: the default of a required option of an :class:`OptionGroup`
REQUIRED = inspect.Parameter.empty


class OptionGroup:
    """Options declared once and shared by several commands: decorating a command with the group
    adds its options to the command's signature (after the command's own) and hands their
    values to the command as one dict, the keyword ``name`` (``{option: value}``).

    Args:
        name: the command's parameter that receives the dict (left out of its options).
        **options: ``option name: (Annotated type, default)``, in the order ``--help`` shows;
            the default :data:`REQUIRED` makes the option required.
    """

    def __init__(self, name: str, **options: tuple) -> None:
        self.name = name
        self.options = options

    def __call__(self, command: Callable) -> Callable:
        sig = inspect.signature(command, eval_str=True)
        own = [p for p in sig.parameters.values() if p.name != self.name]
        added = [
            inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY, annotation=a, default=d)
            for k, (a, d) in self.options.items()
        ]

        @functools.wraps(command)
        def run(*args, **kwargs):
            group = {k: kwargs.pop(k) for k in self.options}
            return command(*args, **kwargs, **{self.name: group})

        params = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in own] + added
        run.__signature__ = sig.replace(parameters=params)
        run.__annotations__ = {p.name: p.annotation for p in params}
        del run.__wrapped__  # typer reads the signature above, not the command's own
        return run

    def replace(self, **options: tuple) -> OptionGroup:
        """This group with ``options`` (``name: (Annotated type, default)``) in place of its
        own of those names, in the same order (a command's own help for a shared option).

        Raises:
            KeyError: a name the group has no option of.
        """
        unknown = sorted(set(options) - set(self.options))
        if unknown:
            raise KeyError(f"{self.name} has no option {', '.join(unknown)}")
        return OptionGroup(self.name, **{**self.options, **options})

    def __add__(self, other: OptionGroup) -> OptionGroup:
        """This group's options followed by ``other``'s, under this group's name."""
        return OptionGroup(self.name, **self.options, **other.options)


#: order marginalization's options (``--orders K`` and its settings), for :func:`order_options`
ORDER_OPTIONS = OptionGroup(
    "order_flags",
    orders=(
        Annotated[
            int | None,
            typer.Option(
                min=2,
                help="answer each prompt over K orders of its passages and aggregate (order "
                "marginalization, arXiv 2310.07712; any backend, a remote one too; K times the "
                "decoding)",
            ),
        ],
        None,
    ),
    orders_design=(
        Annotated[
            str | None,
            typer.Option(
                help="--orders: rotate (evenly spaced cyclic shifts; default) or shuffle "
                "(seeded permutations)"
            ),
        ],
        None,
    ),
    orders_aggregate=(
        Annotated[
            str | None,
            typer.Option(
                help="--orders: score-max (each candidate answer scored under every order, the "
                "one most likely under any; default, the tune range's best), score (the one "
                "most likely on average), max (the answer whose first token is most likely), "
                "weighted (a vote weighted by probability) or plurality"
            ),
        ],
        None,
    ),
    orders_seed=(
        Annotated[int | None, typer.Option(help="--orders-design shuffle: seed (default 0)")],
        None,
    ),
)


def order_options(flags: dict):
    """The :class:`~ragfix.backends.orders.OrderOptions` of the :data:`ORDER_OPTIONS` flags
    given, or ``None`` without ``--orders``.

    Raises:
        ConfigError: a setting of ``--orders`` without it.
        pydantic.ValidationError: an unknown design or aggregator.
    """
    given = {k: v for k, v in flags.items() if v is not None}
    if "orders" not in given:
        if given:
            flag = "--" + next(iter(given)).replace("_", "-")
            raise ConfigError(f"{flag} is a setting of --orders K: give --orders too")
        return None
    from ragfix.backends.orders import OrderOptions

    return OrderOptions(**{k.removeprefix("orders_"): v for k, v in given.items()})


#: the options of a served model (``--model openai:NAME``), for :func:`remote_options`
REMOTE_OPTIONS = OptionGroup(
    "remote",
    api_base=(ApiBaseOpt, None),
    tokenizer=(TokenizerOpt, None),
    context_window=(ContextWindowOpt, None),
    concurrency=(ConcurrencyOpt, None),
    max_retries=(MaxRetriesOpt, None),
    timeout=(TimeoutOpt, None),
)


#: the model backend's options (``--model``, ``--backend``, its options, adapter, device and
#: dtype), one group for every command that loads a backend, for :func:`backend_reference`
BACKEND_OPTIONS = OptionGroup(
    "backend_flags",
    model=(ModelOpt, "smollm2"),
    backend=(BackendOpt, "vanilla"),
    backend_opt=(BackendOptsOpt, None),
    calibration=(CalibrationOpt, None),
    adapter=(AdapterOpt, None),
    train_window=(TrainWindowOpt, None),
    device=(DeviceOpt, "auto"),
    dtype=(DtypeOpt, "auto"),
)


def backend_reference(flags: dict, remote: dict | None = None, orders=None):
    """The :class:`~ragfix.backends.BackendRef` of the :data:`BACKEND_OPTIONS` flags, the
    :data:`REMOTE_OPTIONS` given (``remote``, for ``--model openai:NAME``) and the
    :func:`order_options` (``orders``), checked: its options validated once, before anything is
    loaded, and not again by the run function or loader it is handed to.

    Raises:
        ConfigError: an unknown backend, a missing adapter, a remote flag without a served model.
        pydantic.ValidationError: an unknown or invalid backend option.
    """
    from ragfix.eval.run import backend_reference as reference

    ref, _ = reference(
        flags["backend"],
        model=flags["model"],
        adapter=flags["adapter"],
        backend_options={
            **backend_options(flags["backend_opt"], flags["calibration"], flags["train_window"]),
            **remote_options(flags["model"], remote or {}),
        },
        orders=None if orders is None else orders.model_dump(),
        device=flags["device"],
        dtype=flags["dtype"],
    )
    return ref


def show_tables(tables, details: dict, json_out: Path | None, keep_all: bool = False) -> None:
    """Print a benchmark's or tune's table (or tables); with ``--json`` keep the first (every
    one with ``keep_all``) as a result file, ``details`` beside it."""
    from ragfix.eval.results import write_benchmark
    from ragfix.tables import print_tables

    tables = tables if isinstance(tables, list) else [tables]
    print_tables(tables, console)
    if json_out is not None:
        write_benchmark(json_out, tables if keep_all else tables[0], **details)
        console.print(f"result file: {json_out}", highlight=False, soft_wrap=True)


GateOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--gate",
        help="a condition on the curve for CI, repeatable: mean|worst|gap|diff >=|<= X (e.g. "
        "worst>=0.3, gap<=0.1, diff>=-0.05 against --baseline); it holds when the whole 95% "
        "interval clears X; a failing one exits 1 with its figure and interval",
    ),
]
BaselineOpt = Annotated[
    Path | None,
    typer.Option(
        help="--gate diff: a finished run folder with the same cells to pair with (the "
        "baseline; default for a pipeline run: its first strategy)"
    ),
]


ShardOpt = Annotated[
    str | None,
    typer.Option(
        help="compute job I of N only (0-based I/N, e.g. $SLURM_ARRAY_TASK_ID/4): a disjoint "
        "part of the cells into this folder, no summary; ragfix merge joins the shards",
    ),
]


def shard_value(shard: str | None, gate: list[str] | None = None):
    """``--shard`` parsed before any work (:meth:`ragfix.eval.shard.Shard.parse`).

    Raises:
        ConfigError: a malformed ``I/N``, or a ``--gate`` with it (a gate holds on a whole run).
    """
    from ragfix.eval.shard import Shard

    parsed = Shard.parse(shard)
    if parsed is not None and gate:
        raise ConfigError(
            "--gate checks a whole run: gate the merged run (ragfix report --gate), not a shard"
        )
    return parsed


def shard_finished(result) -> bool:
    """Whether ``result`` is a job shard's (:class:`ragfix.eval.run.ShardDone`), having printed
    the one line it ends with instead of a summary."""
    from ragfix.eval.run import ShardDone

    if isinstance(result, ShardDone):
        console.print(result.line(), highlight=False, soft_wrap=True)
        return True
    return False


def gate_conditions(gate: list[str] | None, baseline: Path | None) -> list:
    """The ``--gate`` conditions, checked with the ``--baseline`` folder before any work.

    Raises:
        ConfigError: a malformed condition, ``--baseline`` without ``--gate``, or a baseline
            that is not a finished run folder.
    """
    from ragfix.eval.compare import load_run
    from ragfix.eval.gate import parse_gates

    conditions = parse_gates(gate)
    if baseline is not None:
        if not conditions:
            raise ConfigError(
                "--baseline is the run a --gate diff condition pairs with: give --gate"
            )
        load_run(baseline)
    return conditions


def apply_gates(runs: list[Path], conditions: list) -> None:
    """Check ``conditions`` on the comparison of ``runs`` (``ragfix report``'s; the gated run
    last): each failure one line on stderr and exit code 1, else one line saying it passed.

    Raises:
        ConfigError: see :func:`~ragfix.eval.gate.gate_failures`.
    """
    from ragfix.eval.compare import compare_runs

    check_gates(compare_runs(runs), conditions)


def check_gates(comparison: dict, conditions: list) -> None:
    """See :func:`apply_gates`: ``conditions`` on a comparison already made."""
    from ragfix.eval.gate import gate_failures

    failed = gate_failures(comparison, conditions)
    for line in failed:
        err_console.print(line, highlight=False, soft_wrap=True)
    if failed:
        raise typer.Exit(1)
    console.print(f"gate passed: {', '.join(map(str, conditions))}", highlight=False)
