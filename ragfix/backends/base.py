"""The model interface every consumer uses (sweep, judge, perplexity, calibration, postprocessor,
``RagFixLLM``), in the spirit of lm-evaluation-harness's ``LM``.

A :class:`Backend` answers prompts and scores text; it does not say how. The Hugging Face
implementation (:mod:`ragfix.backends.hf`) and every method built on it (channel scaling, GALI,
RoPE scaling, truncation, any adapter) fill it, and a remote model over HTTP fills the same
methods. Consumers never look at a backend's class, its model or its private methods: what differs
between backends is declared by :attr:`Backend.supports_prefix_reuse`,
:attr:`Backend.supports_batching` and :attr:`Backend.needs_passage_spans`.

A prompt is either a :class:`~ragfix.prompts.TaskPrompt` (the user turn is wrapped in the model's
chat template, the assistant turn is opened and prefilled with its ``assistant_prefix``; it brings
its own token budget and stop rule) or a plain string, used as it is.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
from pydantic import BaseModel, ConfigDict

from ragfix.errors import Cancelled, ConfigError, RagfixError
from ragfix.prompts import TaskPrompt
from ragfix.types import CUT_TO_WINDOW, OVERFLOW, REASONING_UNFINISHED, Generation

Prompt = TaskPrompt | str

#: answer budget of a plain-string prompt (which also stops at a newline)
DEFAULT_MAX_NEW_TOKENS = 32


class TokenScores(NamedTuple):
    """What the model gives each token of a sequence of ``n`` tokens after the ones before it
    (:meth:`Backend.token_scores`), all on the CPU, rows ``t = 1..n-1``.

    Attributes:
        logprobs: float32 ``[n - 1]``: ``log p(ids[t] | ids[:t])``.
        top_logprobs: float32 ``[n - 1, k]``: the ``k`` largest log-probabilities of the
            distribution ``ids[t]`` was drawn from, largest first (``k`` may be 0).
        top_ids: int64 ``[n - 1, k]``: their token ids.
    """

    logprobs: torch.Tensor
    top_logprobs: torch.Tensor
    top_ids: torch.Tensor

    @staticmethod
    def of(logp: torch.Tensor, targets: torch.Tensor, top: int) -> TokenScores:
        """The scores of ``targets`` ``[m]`` under the log-probability rows ``logp``
        ``[m, vocab]`` (row ``i`` is the distribution ``targets[i]`` was drawn from)."""
        best = logp.topk(top, dim=-1)
        return TokenScores(
            logp.gather(1, targets[:, None]).squeeze(1).cpu(),
            best.values.cpu(),
            best.indices.cpu(),
        )

    @staticmethod
    def cat(parts: Sequence[TokenScores]) -> TokenScores:
        """Consecutive rows of one sequence, joined in order."""
        return TokenScores(*(torch.cat(column) for column in zip(*parts, strict=True)))


class Cancel(Protocol):
    """What stops a generation from another thread (a ``threading.Event`` is one): a backend
    asks :meth:`is_set` between decoding steps and, once it is true, stops decoding (one more
    step at most) and raises :class:`~ragfix.errors.Cancelled`."""

    def is_set(self) -> bool:
        """Whether the generation is to stop."""
        ...


class BackendOptions(BaseModel):
    """Settings of a backend (none for vanilla); subclasses add their method's fields.

    Frozen once built (they are hashed into run and cell ids) and strict: an unknown option is
    refused (``pydantic.ValidationError``), so a typo is never ignored.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: fields that change how the backend is called, never what it answers (a remote model's
    #: concurrency, retries, timeout): left out of run configurations and cell ids, so a rerun
    #: with other values resumes the same run
    call_settings: ClassVar[frozenset[str]] = frozenset()


def validated_options(
    model: type[BackendOptions], options: BackendOptions | None, kwargs: dict
) -> BackendOptions:
    """A backend's options: ``options`` as given when already validated (an instance of
    ``model``), else ``model(**kwargs)``.

    Raises:
        pydantic.ValidationError: an unknown or invalid keyword option.
        TypeError: both ``options`` and ``kwargs``, or ``options`` of another model.
    """
    if options is None:
        return model(**kwargs)
    if kwargs or not isinstance(options, model):
        raise TypeError(f"options must be one {model.__name__} and no keyword options")
    return options


@dataclass(frozen=True)
class Fit:
    """Whether a prompt and its answer budget fit a backend's window: the one verdict every
    consumer (sweep, judge, framework components, server) acts on (:meth:`Backend.fit`). All
    counts are tokens.

    Attributes:
        prompt_tokens: tokens the model reads for the prompt (``len(backend.encode(prompt))``:
            chat template and assistant prefix included), or ``None`` when the backend cannot
            count them here (:attr:`Backend.has_tokenizer` ``False``).
        budget: answer tokens the prompt asks for (:func:`answer_rules`).
        window: the backend's :attr:`~Backend.context_window` (prompt plus answer).
        cuts_long_prompts: the backend cuts a prompt longer than its window by design
            (:attr:`Backend.cuts_long_prompts`).
    """

    prompt_tokens: int | None
    budget: int
    window: int
    cuts_long_prompts: bool = False

    @property
    def fits(self) -> bool | None:
        """``prompt_tokens + budget <= window``; ``None`` when ``prompt_tokens`` is unknown."""
        if self.prompt_tokens is None:
            return None
        return self.prompt_tokens + self.budget <= self.window

    @property
    def runs(self) -> bool:
        """Whether a consumer should run the prompt: it fits, its size is unknown (check
        afterwards, on the tokens the model counted: :meth:`counted`), or the backend cuts long
        prompts by design."""
        return self.fits is not False or self.cuts_long_prompts

    @property
    def flag(self) -> str | None:
        """``None`` when the prompt fits (or its size is unknown); else :data:`OVERFLOW`
        (``"overflow"``: not to be run) or, for a backend that cuts long prompts,
        :data:`CUT_TO_WINDOW` (``"cut_to_window"``: runs on the cut prompt)."""
        if self.fits is not False:
            return None
        return CUT_TO_WINDOW if self.cuts_long_prompts else OVERFLOW

    def counted(self, prompt_tokens: int) -> Fit:
        """The same verdict with the prompt's size as the model counted it once it had read it
        (a remote model's ``Generation.prompt_tokens``)."""
        return replace(self, prompt_tokens=prompt_tokens)


class Backend(ABC):
    """A causal LM ready to answer prompts and score text.

    Attributes:
        name: registry name (``"vanilla"``, ``"channel-scaled"``, ...).
        options: the validated, frozen backend options.
        supports_prefix_reuse: a KV cache computed for a prompt prefix may be reused for another
            prompt with the same prefix (the sweep then runs a sample's cells in sequence).
        supports_batching: a prompt's answer does not depend on the prompts batched with it;
            when ``False``, :meth:`generate` runs prompts one at a time.
        cuts_long_prompts: the backend itself cuts a prompt longer than :attr:`context_window`
            by design (the ``truncated`` baseline); otherwise consumers refuse or flag such a
            prompt (``overflow``) instead of running it. :meth:`fit` gives the verdict.
        has_tokenizer: :meth:`tokenize`, :meth:`encode` and :meth:`count_tokens` work here; when
            ``False`` (a remote model given no tokenizer) they raise, and a prompt's size is
            known only after the model has read it (``Generation.prompt_tokens``, from the
            server's usage figures), so consumers check the window afterwards.
        preferred_batch_size: prompts per :meth:`generate` call that keep the backend busy (a
            remote model: its number of requests in flight), or ``None`` to let the caller
            choose.
        needs_passage_spans: the backend reads a prompt's passages where the prompt says they
            are (:attr:`~ragfix.prompts.TaskPrompt.passages`: the task prompts of the sweep and
            the judge) and refuses any other prompt (a plain text, a chat message, a
            framework's rendered prompt); a consumer whose prompts never carry passages (the
            framework components) refuses such a backend before any work
            (:func:`require_plain_prompts`), and ``ragfix serve`` refuses the requests that do
            not send their passages as ``documents`` (:func:`plain_prompt_refusal`).
        supports_step_decoding: :meth:`decoder` decodes step by step: a prompt added between
            steps joins the running batch at the next step and a finished or dropped row
            leaves it (continuous batching, :attr:`Decoder.continuous`); when ``False`` it
            answers its rows by whole :meth:`generate` calls.
    """

    name: ClassVar[str] = "vanilla"
    options: BackendOptions
    supports_prefix_reuse: bool = True
    supports_batching: bool = True
    cuts_long_prompts: bool = False
    has_tokenizer: bool = True
    preferred_batch_size: int | None = None
    needs_passage_spans: bool = False
    supports_step_decoding: bool = False

    # ------------------------------------------------------------------ what it is
    @property
    @abstractmethod
    def context_window(self) -> int:
        """Tokens the backend can read (prompt plus answer)."""

    @property
    @abstractmethod
    def model_name(self) -> str:
        """The name the model was loaded by (``smollm2``, a hub id, a path, a served name)."""

    @property
    def device(self) -> torch.device | None:
        """Where the model's weights are, or ``None`` where this process holds none (a remote
        model: the base)."""
        return None

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype of the model's weights, or ``None`` where this process holds none (a remote
        model: the base)."""
        return None

    @abstractmethod
    def identity(self) -> dict:
        """What makes two results comparable: model fingerprint, backend name, options and any
        adapter or calibration applied (with their fingerprints). JSON-serialisable."""

    # ------------------------------------------------------------------ text and tokens
    @abstractmethod
    def format_prompt(self, prompt: Prompt) -> str:
        """The exact text the model reads for ``prompt`` (chat template applied for a
        :class:`TaskPrompt`, assistant turn opened and prefilled)."""

    @property
    def reads_chat_template(self) -> bool:
        """Whether a :class:`TaskPrompt` is read in a chat template (its user turn, then the
        assistant turn prefilled) rather than in its task's completion form (a base model:
        :meth:`~ragfix.prompts.TaskPrompt.answer_prefix` with ``chat=False``)."""
        return True

    def read_prompt(self, prompt: Prompt) -> Prompt:
        """The prompt whose text :meth:`format_prompt` gives the model: ``prompt`` itself, or,
        for a backend that rearranges the passages before reading (``attention-sort``), the
        rearranged task prompt (each passage with its label)."""
        return prompt

    @abstractmethod
    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens added)."""

    @abstractmethod
    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of token ids (special tokens dropped)."""

    def forget_prompts(self) -> None:
        """Forget what earlier calls kept per prompt (a memoised reading of a prompt, the KV cache
        of the previous prompt's prefix), so that the next call computes everything a new
        prompt costs (benchmarks). Caches that a run amortises over all its prompts (a bias
        measured once per template) are kept. The base keeps nothing."""
        return None

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids the model reads for ``prompt``: ``tokenize(format_prompt(prompt))``."""
        return self.tokenize(self.format_prompt(prompt))

    def count_tokens(self, text: str) -> int:
        """Number of tokens of ``text`` (no special tokens)."""
        return len(self.tokenize(text))

    def fit(self, prompt: Prompt, max_new_tokens: int | None = None) -> Fit:
        """Whether ``prompt`` and its answer budget fit :attr:`context_window` (tokens).

        Args:
            prompt: the prompt, as it would be given to :meth:`generate`.
            max_new_tokens: the answer budget, as it would be given to :meth:`generate`
                (default: the prompt's own, see :func:`answer_rules`).

        Returns:
            a :class:`Fit`: ``prompt_tokens = len(encode(prompt))`` (``None`` without
            :attr:`has_tokenizer`), ``budget``, ``window = context_window``; it fits when
            ``prompt_tokens + budget <= window``.
        """
        budget, _ = answer_rules(prompt, max_new_tokens, None)
        return Fit(
            prompt_tokens=len(self.encode(prompt)) if self.has_tokenizer else None,
            budget=budget,
            window=self.context_window,
            cuts_long_prompts=self.cuts_long_prompts,
        )

    # ------------------------------------------------------------------ generation
    @abstractmethod
    def generate(
        self,
        prompts: Sequence[Prompt],
        *,
        batch_size: int = 8,
        max_new_tokens: int | None = None,
        stop_at_newline: bool | None = None,
        first_logprobs: bool = False,
        prefix_reuse: bool = False,
        cancel: Cancel | None = None,
    ) -> list[Generation]:
        """Greedy answers to ``prompts``.

        Args:
            prompts: ``B`` prompts; a :class:`TaskPrompt` brings its budget and stop rule unless
                overridden here; a plain string gets 32 tokens and stops at a newline.
            batch_size: prompts per forward pass (ignored without :attr:`supports_batching`).
            first_logprobs: also return each answer's first-step next-token log-probabilities
                (``Generation.first_logprobs``, float32 ``[vocab_size]`` on the CPU), computed
                on exactly the input the answer was generated from.
            prefix_reuse: run the prompts in order, reusing the KV cache of the longest common
                token prefix with the previous prompt (only where
                :attr:`supports_prefix_reuse`; otherwise ignored).
            cancel: asked between decoding steps (a remote model: before each request); once
                set, decoding stops within one step and the call raises.

        Returns:
            ``B`` :class:`Generation` objects, in the input order.

        Raises:
            Cancelled: ``cancel`` was set before every answer was complete.
        """

    @abstractmethod
    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 256,
        stop_at_newline: bool = False,
        cancel: Cancel | None = None,
    ) -> Iterator[str]:
        """Yield the greedy answer to one prompt piece by piece; closing the iterator (or the
        newline rule) stops the generation.

        Raises:
            Cancelled: ``cancel`` was set (asked between decoding steps) before the answer was
                complete; decoding stopped within one step.
        """

    def decoder(self, prefix_reuse: bool = False) -> Decoder:
        """A :class:`Decoder` of greedy answers whose rows join and leave between decoding steps
        (what ``ragfix serve`` schedules). The base answers its rows by whole :meth:`generate`
        calls (:class:`Decoder`); a backend that :attr:`supports_step_decoding` returns one that
        decodes all its rows one token a step.

        Args:
            prefix_reuse: as for :meth:`generate` (ignored without
                :attr:`supports_prefix_reuse`).
        """
        return Decoder(self, prefix_reuse)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """The bytes each token id stands for on its own (a byte-level token may hold only part
        of a character's UTF-8 encoding). The base encodes each token's :meth:`detokenize`
        text, exact for tokens that decode to whole characters."""
        return [self.detokenize([i]).encode() for i in ids]

    # ------------------------------------------------------------------ scoring
    @abstractmethod
    def next_token_logprobs(self, prompts: Sequence[Prompt], *, batch_size: int = 8):
        """Log-probabilities of the next token after each prompt.

        Returns:
            float32 tensor ``[B, vocab_size]`` on the CPU.
        """

    @abstractmethod
    def token_logprobs(self, ids: Sequence[int]) -> torch.Tensor:
        """Log-probability of each token given the ones before it (rolling, for perplexity).

        Args:
            ids: one token sequence of length ``n >= 2``.

        Returns:
            float32 ``[n - 1]`` on the CPU: ``log p(ids[t] | ids[:t])`` for ``t = 1..n-1``.
        """

    def token_scores(self, ids: Sequence[int], top: int) -> TokenScores:
        """:meth:`token_logprobs` with each token's ``top`` most likely alternatives, computed in
        the same pass (``logprobs`` equal to :meth:`token_logprobs`'s; what a scoring client of
        ``ragfix serve`` reads: OpenAI completions ``echo`` with ``logprobs: N``).

        Args:
            ids: one token sequence of length ``n >= 2``.
            top: alternatives per token (``0``: none).

        Returns:
            :class:`TokenScores` of rows ``t = 1..n-1``.

        Raises:
            RagfixError: a backend that does not give the distributions of a text's tokens (the
                base: every backend that scores text overrides it).
        """
        raise RagfixError(
            f"backend {self.name!r} does not give the distribution of each token of a text "
            "(top alternatives of scored tokens): use a local model"
        )

    def loglikelihood(self, pairs: Sequence[tuple[Prompt, str]]) -> list[float]:
        """Summed log-probability (nats) of each continuation given its context.

        The continuation's tokens are ``tokenize(continuation)`` appended to
        ``encode(context)`` (so a :class:`TaskPrompt` context is chat-formatted first).

        Args:
            pairs: ``(context, continuation)`` pairs; continuations must not be empty.

        Returns:
            one float per pair, ``<= 0``.

        Raises:
            ValueError: an empty continuation.
        """
        out = []
        for context, continuation in pairs:
            ctx, cont = self.encode(context), self.tokenize(continuation)
            if not cont:
                raise ValueError("loglikelihood needs a non-empty continuation")
            out.append(float(self.token_logprobs(ctx + cont)[-len(cont) :].sum()))
        return out


class AllSet:
    """A :class:`Cancel` set once every one of ``signals`` is (a batch whose clients are all
    gone)."""

    def __init__(self, signals: Sequence[Cancel]):
        self.signals = list(signals)

    def is_set(self) -> bool:
        return all(s.is_set() for s in self.signals)


@dataclass
class _Queued:
    """A row of the base :class:`Decoder`: its prompt, its rules and its cancel signal."""

    prompt: Prompt
    rules: tuple[int, bool, bool]  # budget, stop rule, first_logprobs
    cancel: Cancel | None


class Decoder:
    """Greedy answers to prompts that are added and dropped between decoding steps: the model
    interface of continuous batching (iteration-level scheduling: Yu et al., "Orca", OSDI
    2022, section 3; what vLLM and TGI run).

    Its rows are identified by the ids :meth:`add` returns; :meth:`step` advances every row and
    returns the finished ones; :meth:`drop` removes a row (its client went away). Each row's
    answer is its greedy answer alone (``Backend.generate([prompt])``).

    This base, for a backend that does not :attr:`~Backend.supports_step_decoding`, runs rows
    to completion: each :meth:`step` answers the rows that share the first row's budget, stop
    rule and ``first_logprobs`` by one :meth:`Backend.generate` call (``batch_size`` the number
    of rows, ``cancel`` set once all their signals are); when that call fails for another
    reason than cancellation, each of them is answered alone, so one prompt's failure is not
    the others'.

    Attributes:
        continuous: a row added between steps joins the running batch at the next step (a
            step decoder); ``False`` here: :meth:`step` runs its rows to completion.
    """

    continuous: ClassVar[bool] = False

    def __init__(self, backend: Backend, prefix_reuse: bool = False):
        self.backend, self.prefix_reuse = backend, prefix_reuse
        self._queued: dict[int, _Queued] = {}
        self._ids = 0

    def _new_row(self) -> int:
        self._ids += 1
        return self._ids

    def __len__(self) -> int:
        """The rows added and not yet finished or dropped."""
        return len(self._queued)

    def add(
        self,
        prompt: Prompt,
        max_new_tokens: int | None = None,
        stop_at_newline: bool | None = None,
        first_logprobs: bool = False,
        cancel: Cancel | None = None,
    ) -> int:
        """Add a row answering ``prompt`` (budget and stop rule: :func:`answer_rules`;
        ``first_logprobs`` as for :meth:`Backend.generate`); its id.

        ``cancel`` is asked between the decoding steps of a :meth:`step` that runs rows to
        completion (this base); a step decoder ignores it (its caller drops the row).

        Raises:
            RagfixError: a prompt the backend cannot read (a step decoder, which reads it here).
        """
        row = self._new_row()
        budget, stop = answer_rules(prompt, max_new_tokens, stop_at_newline)
        self._queued[row] = _Queued(prompt, (budget, stop, first_logprobs), cancel)
        return row

    def drop(self, row: int) -> None:
        """Remove ``row`` (a finished or unknown id is ignored)."""
        self._queued.pop(row, None)

    def tokens(self, row: int) -> list[int]:
        """The tokens ``row`` has generated so far (none in this base before it finishes)."""
        return []

    def step(self) -> dict[int, Generation | Exception]:
        """Advance the rows: here, answer the rows that share the first row's rules.

        Returns:
            the rows that finished: their :class:`Generation`, or the exception that ended them
            (:class:`~ragfix.errors.Cancelled` once all their signals were set); they are no
            longer rows.
        """
        if not self._queued:
            return {}
        rules = next(iter(self._queued.values())).rules
        rows = [r for r, q in self._queued.items() if q.rules == rules]
        group = [self._queued.pop(r) for r in rows]
        return dict(zip(rows, self._answer(group), strict=True))

    def _answer(self, group: list[_Queued]) -> list[Generation | Exception]:
        budget, stop, logprobs = group[0].rules
        signals = [q.cancel for q in group if q.cancel is not None]
        try:
            return list(
                self.backend.generate(
                    [q.prompt for q in group],
                    batch_size=len(group),
                    max_new_tokens=budget,
                    stop_at_newline=stop,
                    first_logprobs=logprobs,
                    prefix_reuse=self.prefix_reuse,
                    cancel=AllSet(signals) if signals else None,
                )
            )
        except Exception as e:
            if len(group) > 1 and not isinstance(e, Cancelled):
                return [out for q in group for out in self._answer([q])]
            return [e] * len(group)


def answer_rules(
    prompt: Prompt, max_new_tokens: int | None, stop_at_newline: bool | None
) -> tuple[int, bool]:
    """The answer budget and stop rule of ``prompt``: the arguments of
    :meth:`Backend.generate` when given, else a :class:`TaskPrompt`'s own, else
    :data:`DEFAULT_MAX_NEW_TOKENS` tokens stopping at a newline for a plain string."""
    if isinstance(prompt, TaskPrompt):
        mnt, stop = prompt.max_new_tokens, prompt.stop_at_newline
    else:
        mnt, stop = DEFAULT_MAX_NEW_TOKENS, True
    return max_new_tokens or mnt, stop if stop_at_newline is None else stop_at_newline


#: the tags a reasoning model writes its thinking between (DeepSeek-R1, Qwen3, QwQ: ``think``)
REASONING_TAGS = ("think", "thinking", "reasoning")
_TAGS = "|".join(REASONING_TAGS)
_OPEN = re.compile(rf"<({_TAGS})>", re.IGNORECASE)
_CLOSE = re.compile(rf"</({_TAGS})>", re.IGNORECASE)
_BLOCK = re.compile(rf"<({_TAGS})>.*?</\1>", re.IGNORECASE | re.DOTALL)


def final_answer(text: str, stop_at_newline: bool) -> tuple[str, dict[str, str]]:
    """A generated text as every backend returns it, and the flags it raises.

    A reasoning model's thinking is never part of the answer (tags: :data:`REASONING_TAGS`, any
    case): a closing tag with no opening one before it ends thinking opened in the prompt (as
    Qwen3's and DeepSeek-R1's chat templates do), so everything up to it is dropped; every
    whole block ``<think>...</think>`` is dropped; an opening tag that is never closed ends the
    answer there, and when nothing but white space came before it there is no final answer: the
    text is ``""`` and flagged :data:`~ragfix.types.REASONING_UNFINISHED` (not scored). What
    is left is stripped of white space and, with the newline stop rule, cut at the first newline
    after any leading white space.

    Returns:
        ``(answer, {flag: reason})``; no flags for an answer without an unfinished block.
    """
    close, first = _CLOSE.search(text), _OPEN.search(text)
    if close is not None and (first is None or first.start() > close.start()):
        text = text[close.end() :]
    text = _BLOCK.sub("", text)
    opened = _OPEN.search(text)
    if opened is not None:
        text = text[: opened.start()]
        if not text.strip():
            why = f"<{opened.group(1)}> opened and never closed: no final answer"
            return "", {REASONING_UNFINISHED: why}
    if stop_at_newline:
        text = text.strip().split("\n")[0]
    return text.strip(), {}


def cut_at_newline(pieces: Iterator[str]) -> Generator[str, None, Any]:
    """Stream ``pieces`` up to (not including) the first newline after any leading white space,
    then stop; closes ``pieces`` when it stops early or is closed itself. Returns what
    ``pieces`` returned when it ran to its end uncut (``None`` when cut)."""
    so_far = ""
    try:
        while True:
            try:
                piece = next(pieces)
            except StopIteration as end:
                return end.value
            both = so_far + piece
            cut = both.find("\n", len(both) - len(both.lstrip()))
            if cut >= 0:
                if cut > len(so_far):
                    yield both[len(so_far) : cut]
                return
            if piece:
                so_far = both
                yield piece
    finally:
        close = getattr(pieces, "close", None)
        if close is not None:
            close()


def plain_prompt_refusal(backend: Backend) -> str | None:
    """Why a loaded ``backend`` refuses a prompt that does not say where its passages are (a
    plain chat message), or ``None`` when it answers one.

    Declared by :attr:`~Backend.needs_passage_spans`, or found by trying one: a backend that
    declares nothing but refuses a one-word task prompt (:meth:`~Backend.fit` raises a
    :class:`~ragfix.errors.RagfixError`) gives its own reason (the first line). A caller whose
    prompts sometimes say (``ragfix serve``: a chat request with ``documents``) refuses only the
    others with this reason; :func:`require_plain_prompts` refuses the backend.
    """
    if backend.needs_passage_spans:
        return f"backend {backend.name!r} reads a prompt's passages where the prompt says they are"
    try:
        backend.fit(TaskPrompt(user="Hello"))
    except RagfixError as e:
        return str(e).strip().splitlines()[0]
    return None


def require_plain_prompts(
    backend: Backend | type[Backend], consumer: str, name: str | None = None
) -> None:
    """Refuse ``backend`` for ``consumer``, a caller whose prompts carry no passage spans (a
    framework's rendered text), when the backend would refuse every such prompt.

    A class is judged by its declaration, :attr:`~Backend.needs_passage_spans` (so a caller can
    refuse before any weights are loaded: :func:`ragfix.backends.backend_class`); a loaded
    backend also by trying one (:func:`plain_prompt_refusal`), refused with its own reason.

    Args:
        backend: the backend, or its class.
        consumer: who asks, as the message names it (``"a framework's LLM component"``).
        name: the backend's registry name (default: ``backend.name``).

    Raises:
        ConfigError: such a backend (one line, naming it and why).
    """
    head = f"backend {name or backend.name!r} cannot run under {consumer}"
    if backend.needs_passage_spans:
        raise ConfigError(
            f"{head}: it reads a prompt's passages where the prompt says they are, and "
            f"{consumer} gets prompts that do not say (a framework's text); use it with ragfix "
            "eval, ragfix judge or ragfix serve (documents), or choose another backend"
        )
    if isinstance(backend, Backend):
        reason = plain_prompt_refusal(backend)
        if reason is not None:
            raise ConfigError(f"{head}, whose prompts do not say where passages are: {reason}")


def check_cancel(cancel: Cancel | None) -> None:
    """Raise :class:`~ragfix.errors.Cancelled` when ``cancel`` is set (what a backend calls
    after a decoding loop that ``cancel`` may have stopped).

    Raises:
        Cancelled: ``cancel`` is set.
    """
    if cancel is not None and cancel.is_set():
        raise Cancelled("the generation was cancelled")


__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "AllSet",
    "Backend",
    "BackendOptions",
    "Cancel",
    "Decoder",
    "Fit",
    "Prompt",
    "answer_rules",
    "check_cancel",
    "final_answer",
    "cut_at_newline",
    "plain_prompt_refusal",
    "require_plain_prompts",
    "validated_options",
]
