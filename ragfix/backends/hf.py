"""The Hugging Face implementation of the model interface, which every local method builds on.

:class:`HFBackend` wraps a ``transformers`` causal LM and its tokenizer: batched greedy decoding
with left padding through ``generate``, batched next-token log-probabilities, rolling token
log-probabilities, streaming, and KV-cache prefix reuse. A method changes the model (an attention
patch through :mod:`ragfix.backends.patching`, a RoPE variant) and, where it needs its own
decoding loop (GALI) or its own input (truncation), overrides the extension points
:meth:`HFBackend.generate_ids`, :meth:`HFBackend.next_logprobs_ids`,
:meth:`HFBackend.token_scores_ids` and :meth:`HFBackend.stream_ids`; a method that reads each
prompt through its own layout and runs its own forward pass (``set-based``, ``pine``,
``calibrated-attention``) builds on :class:`~ragfix.backends.layout.LayoutBackend`;
``ragfix serve`` steps :class:`~ragfix.backends.step_decoder.StepDecoder` over it. Consumers use
only the public :class:`~ragfix.backends.base.Backend` methods.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import ClassVar

import torch

from ragfix.backends.base import (
    Backend,
    BackendOptions,
    Cancel,
    Decoder,
    Prompt,
    TokenScores,
    answer_rules,
    check_cancel,
    final_answer,
    validated_options,
)
from ragfix.backends.family import Family, full_cache, model_family
from ragfix.backends.step_decoder import StepDecoder
from ragfix.models.load import model_identity
from ragfix.prompts import NO_CHAT_TEMPLATE
from ragfix.types import Generation


def bos_text(tokenizer) -> str:
    """The BOS token as text when ``tokenizer`` puts it before every text it encodes (its
    post-processor does: Gemma, Llama 2, Mistral), else ``""``. That is what Hugging Face's
    ``tokenizer(text)``, vLLM's completions endpoint and llama.cpp put first of a plain text; a
    chat template writes its own (Gemma 3's ``{{ bos_token }}``)."""
    bos = getattr(tokenizer, "bos_token_id", None)  # None: a tokenizer without one
    if bos is None:
        return ""
    return tokenizer.bos_token if tokenizer("a")["input_ids"][:1] == [bos] else ""


def chat_text(tokenizer, prompt: Prompt, bos: bool = True) -> str:
    """The text a model with ``tokenizer`` reads for ``prompt``: a :class:`TaskPrompt`'s user turn
    in the tokenizer's chat template, assistant turn opened and prefilled with its
    ``assistant_prefix``; without a chat template (a base model), the task's completion form
    ``user`` and :meth:`~ragfix.prompts.TaskPrompt.answer_prefix`; a string as it is. A text
    that is not a chat template's (a string, a completion form) starts with the tokenizer's
    BOS (:func:`bos_text`) unless it does already, or ``bos`` is false (a server's completions
    endpoint, which puts its own first). Gemma answers without it as if from another model."""
    if not isinstance(prompt, str) and tokenizer.chat_template:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt.user}],
            add_generation_prompt=True,
            tokenize=False,
        )
        return text + prompt.answer_prefix()
    text = prompt if isinstance(prompt, str) else prompt.user + prompt.answer_prefix(chat=False)
    first = bos_text(tokenizer) if bos else ""
    return text if text.startswith(first) else first + text


def greedy_steps(
    logits: torch.Tensor,
    step: Callable[[torch.Tensor], torch.Tensor],
    max_new_tokens: int,
    stops: Callable[[int], bool],
    cancel: Cancel | None = None,
) -> Iterator[tuple[list[int], list[bool], torch.Tensor]]:
    """Greedy decoding from the prefill's logits, for a method with its own decoding loop.

    Args:
        logits: ``[B, n, vocab]`` logits of the prefill (the last position is used).
        step: ``[B, 1]`` next token ids -> ``[B, 1, vocab]`` logits (the method's cached step).
        max_new_tokens: at most this many steps.
        stops: whether a generated token ends its row (EOS, a newline when asked).
        cancel: asked before each step; once set, no further step runs.

    Yields:
        ``(tokens, alive, logprobs)`` per step: the argmax ids ``[B]``, per row whether it had
        not stopped before this token, and the step's log-probabilities ``[B, vocab]`` (float32);
        ends when every row has stopped, after ``max_new_tokens`` steps, or once ``cancel`` is
        set (the caller checks it: :func:`~ragfix.backends.base.check_cancel`).
    """
    alive = [True] * logits.shape[0]
    for i in range(max_new_tokens):
        last = logits[:, -1].float()
        nxt = last.argmax(-1)
        yield nxt.tolist(), list(alive), torch.log_softmax(last, dim=-1)
        alive = [a and not stops(t) for a, t in zip(alive, nxt.tolist(), strict=True)]
        if not any(alive) or i == max_new_tokens - 1 or (cancel is not None and cancel.is_set()):
            return
        logits = step(nxt[:, None])


def stop_signals(*signals: Cancel | None):
    """``model.generate``'s stopping criteria that end every row once any of ``signals`` is set
    (``transformers`` asks after each decoding step); ``None`` entries are ignored."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    live = [s for s in signals if s is not None]

    class _Signalled(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            done = any(s.is_set() for s in live)
            return torch.full((input_ids.shape[0],), done, device=input_ids.device)

    return StoppingCriteriaList([_Signalled()] if live else [])


def byte_level_token_bytes(tokenizer, ids: Sequence[int]) -> list[bytes] | None:
    """The bytes of each token of a byte-level BPE ``tokenizer`` (GPT-2's byte-to-character
    alphabet, read backwards), or ``None`` for a tokenizer of another kind."""
    from tokenizers import decoders

    if not isinstance(tokenizer.backend_tokenizer.decoder, decoders.ByteLevel):
        return None
    # GPT-2's alphabet: printable Latin-1 bytes stand for themselves, the others for 256 + n
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {chr(b): b for b in printable}
    chars.update({chr(256 + n): b for n, b in enumerate(sorted(set(range(256)) - set(printable)))})
    out = []
    for i, piece in zip(ids, tokenizer.convert_ids_to_tokens(list(ids)), strict=True):
        if piece in tokenizer.all_special_tokens or any(c not in chars for c in piece):
            out.append(tokenizer.decode([i]).encode())  # an added token is its own text
        else:
            out.append(bytes(chars[c] for c in piece))
    return out


def template_id(tokenizer) -> str:
    """What identifies a tokenizer's chat template: the first 12 hex digits of its sha1, or
    :data:`NO_CHAT_TEMPLATE`."""
    template = tokenizer.chat_template
    return hashlib.sha1(template.encode()).hexdigest()[:12] if template else NO_CHAT_TEMPLATE


def tokenizer_id(tokenizer) -> str:
    """What identifies how ``tokenizer`` turns text into tokens and back, and where answers
    stop: 16 hex digits of the SHA-256 over its class, its vocabulary and rules (a fast
    tokenizer's whole ``tokenizer.json`` serialization: normalizer, pre-tokenizer, merges, added
    tokens, post-processor; a slow one's vocabulary), its special tokens with their ids (the
    EOS token ends every answer: ``tokenizer_config.json``'s ``eos_token``), and
    ``clean_up_tokenization_spaces`` (decoding). Computed from the loaded tokenizer, so it is
    the same for every source (a folder, a hub snapshot, a GGUF file) and changes with any of
    the files those come from (``tokenizer.json``, ``tokenizer_config.json``,
    ``special_tokens_map.json``, ``added_tokens.json``, vocabulary files)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    rules = backend.to_str() if backend is not None else sorted(tokenizer.get_vocab().items())
    special = {
        k: [str(v), tokenizer.convert_tokens_to_ids(str(v))]
        for k, v in sorted(tokenizer.special_tokens_map.items())
    }
    state = [
        type(tokenizer).__name__,
        rules,
        special,
        bool(getattr(tokenizer, "clean_up_tokenization_spaces", False)),
    ]
    return hashlib.sha256(json.dumps(state, default=str).encode()).hexdigest()[:16]


def generation_id(model) -> str:
    """What identifies the generation settings ``model`` brings (its ``generation_config.json``,
    whose values ``generate`` takes where ragfix sets none): 16 hex digits of the SHA-256 of
    ``model.generation_config``'s values that differ from transformers' defaults."""
    values = model.generation_config.to_diff_dict()
    values.pop("transformers_version", None)
    return hashlib.sha256(json.dumps(values, sort_keys=True, default=str).encode()).hexdigest()[:16]


class HFBackend(Backend):
    """A ``transformers`` causal LM ready to answer prompts (the ``vanilla`` backend as it is;
    the base class of every local method).

    Args:
        model: a ``transformers`` causal LM in eval mode (as from
            :func:`ragfix.models.load.load_model`).
        tokenizer: its tokenizer (left padding, with a pad token).
        adapter: what :func:`ragfix.lora.load_adapter` applied to ``model`` (recorded in
            :meth:`identity`), or ``None``.
        options: the backend's options already validated (an :attr:`options_model`, as
            :func:`ragfix.backends.load_backend` passes them), or None to validate ``**kwargs``.
        **kwargs: the backend's options as keywords (when ``options`` is None).

    Extension points, what a subclass overrides to change how the model is run on token ids
    (every public method reaches the model through them, except prefix reuse, the trie and
    the step decoder, which a subclass that overrides one of them turns off:
    :attr:`supports_prefix_reuse`, :attr:`supports_step_decoding`):

    * :meth:`generate_ids`: greedy answers to a left-padded batch of prompts;
    * :meth:`next_logprobs_ids`: the next-token log-probabilities of a batch of prompts;
    * :meth:`token_scores_ids`: the log-probability of each token of one sequence;
    * :meth:`stream_ids`: one prompt's greedy answer, piece by piece.

    Raises:
        pydantic.ValidationError: an unknown or invalid option.
        TypeError: both ``options`` and keyword options, or ``options`` of another backend.
        UnsupportedModelError: the method cannot run on the model's family
            (:meth:`check_family`).
    """

    name: ClassVar[str] = "vanilla"
    options_model: ClassVar[type[BackendOptions]] = BackendOptions
    #: the model's own forward pass over :meth:`encode`'s tokens, with a KV cache (a method that
    #: changes the tokens in its own loop, or keeps per-prompt state in its patch, sets it False)
    supports_step_decoding = True

    @classmethod
    def load_kwargs(cls, options: BackendOptions) -> dict:
        """Extra keyword arguments for :func:`ragfix.models.load.load_model` (e.g. an attention
        implementation the method needs). None for most backends."""
        return {}

    @classmethod
    def check_family(cls, family: Family, options: BackendOptions) -> None:
        """Refuse, in one line, a model family this method cannot run on with ``options``
        (read from the model's config alone: :func:`~ragfix.backends.family.read_family`, so
        :func:`~ragfix.backends.load_backend` asks before loading any weights). The base runs on
        every family.

        Raises:
            UnsupportedModelError: the method cannot run on ``family``; the message names the
                method, the family and the reason.
        """
        return None

    def __init__(
        self,
        model,
        tokenizer,
        *,
        adapter: dict | None = None,
        options: BackendOptions | None = None,
        **kwargs,
    ):
        self.options = validated_options(self.options_model, options, kwargs)
        self.check_family(model_family(model), self.options)
        self.model = model
        self.tokenizer = tokenizer
        self.adapter = adapter
        self._reuse_cache = None
        self._reuse_ids: list[int] = []
        self._scored: tuple[list[int], TokenScores | None] = ([], None)
        if not tokenizer.chat_template:
            warnings.warn(
                f"{self.model_name}: the tokenizer has no chat template; a TaskPrompt is read in "
                "its task's completion form (recorded in identity())",
                stacklevel=2,
            )

    # ------------------------------------------------------------------ what it is
    @property
    def device(self) -> torch.device:
        """Device of the model's weights."""
        return next(self.model.parameters()).device

    @property
    def model_name(self) -> str:
        """The name the model was loaded by (``smollm2``, a hub id, a path)."""
        return getattr(self.model, "ragfix_name", self.model.config.name_or_path)

    @property
    def context_window(self) -> int:
        """The model's trained window (``max_position_embeddings``)."""
        return int(self.model.config.max_position_embeddings)

    @property
    def reads_chat_template(self) -> bool:
        """See :attr:`Backend.reads_chat_template`: whether the tokenizer has one."""
        return bool(self.tokenizer.chat_template)

    def identity(self) -> dict:
        """Model identity (:func:`~ragfix.models.load.model_identity`: weights fingerprint), the
        weights' dtype (``"torch.float32"``: another dtype computes other answers), the attention
        implementation when it is not ``"sdpa"`` (e.g. float32 decode steps in bf16 on the CPU,
        :mod:`ragfix.models.attention`), backend name, options, the chat template used (a
        hash, or :data:`NO_CHAT_TEMPLATE`), the tokenizer (:func:`tokenizer_id`), the
        generation settings (:func:`generation_id`) and the applied adapter (if any)."""
        out = {
            "model": model_identity(self.model),
            "dtype": str(next(self.model.parameters()).dtype),
            "backend": self.name,
            "options": self.options.model_dump(mode="json"),
        }
        if (attention := self.model.config._attn_implementation) != "sdpa":
            out["attention"] = attention
        out["chat_template"] = template_id(self.tokenizer)
        out["tokenizer"] = tokenizer_id(self.tokenizer)
        out["generation_config"] = generation_id(self.model)
        if self.adapter is not None:
            out["adapter"] = self.adapter
        return out

    def forget_prompts(self) -> None:
        """See :meth:`Backend.forget_prompts`: the prefix-reuse KV cache and the last scored
        sequence go."""
        self._reuse_cache, self._reuse_ids = None, []
        self._scored = ([], None)

    # ------------------------------------------------------------------ text and tokens
    def format_prompt(self, prompt: Prompt) -> str:
        """:func:`chat_text`: a :class:`TaskPrompt`'s user turn in the model's chat template,
        assistant turn opened and prefilled (its task's completion form for a model without
        one); a string as it is; either of the last two after the tokenizer's BOS."""
        return chat_text(self.tokenizer, prompt)

    def tokenize(self, text: str) -> list[int]:
        """Token ids of ``text`` (no special tokens: the chat template carries them)."""
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` without special tokens."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def token_bytes(self, ids: Sequence[int]) -> list[bytes]:
        """See :meth:`Backend.token_bytes`: read from a byte-level vocabulary (each token's own
        bytes, part of a character's included); else a byte-fallback piece (SentencePiece's
        ``<0xNN>``: Gemma, Llama 2) is its byte, and any other token its decoded text (a
        special token's own text: ``<bos>``)."""
        exact = byte_level_token_bytes(self.tokenizer, ids)
        if exact is not None:
            return exact
        pieces = self.tokenizer.convert_ids_to_tokens(list(ids))
        out = []
        for i, piece in zip(ids, pieces, strict=True):
            byte = re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", piece or "")
            out.append(bytes([int(byte[1], 16)]) if byte else self.tokenizer.decode([i]).encode())
        return out

    # ------------------------------------------------------------------ generation
    def _generation_config(self, max_new_tokens: int, stop_at_newline: bool, **extra):
        from transformers import GenerationConfig

        return GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            stop_strings=["\n"] if stop_at_newline else None,
            **extra,
        )

    def _decode_answer(
        self, new_ids: Sequence[int], stop_at_newline: bool
    ) -> tuple[str, list[int], dict[str, str]]:
        """Answer text (:func:`~ragfix.backends.base.final_answer`), the generated token ids
        (padding after EOS dropped) and the answer's flags with their reasons."""
        ids = [i for i in new_ids if i != self.tokenizer.pad_token_id]
        text, flags = final_answer(
            self.tokenizer.decode(ids, skip_special_tokens=True), stop_at_newline
        )
        return text, ids, flags

    def _left_pad(self, batch: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T]`` input ids and attention mask, left padded to the longest prompt."""
        width = max(len(x) for x in batch)
        pad = self.tokenizer.pad_token_id
        ids = [[pad] * (width - len(x)) + list(x) for x in batch]
        mask = [[0] * (width - len(x)) + [1] * len(x) for x in batch]
        return (
            torch.tensor(ids, device=self.device),
            torch.tensor(mask, device=self.device),
        )

    @torch.no_grad()
    def generate_ids(
        self,
        batch: list[list[int]],
        max_new_tokens: int,
        stop_at_newline: bool,
        first_logprobs: bool = False,
        cancel: Cancel | None = None,
    ) -> list[Generation]:
        """Extension point: greedy decoding of ``B`` token-id prompts in one left-padded batch
        (what a method with its own decoding loop or its own input overrides); ``cancel`` stops
        it between steps (the caller checks it).

        Returns:
            one :class:`Generation` per prompt, in order (``first_logprobs`` float32
            ``[vocab]`` when asked for).
        """
        start = time.perf_counter()
        ids, mask = self._left_pad(batch)
        cfg = self._generation_config(
            max_new_tokens,
            stop_at_newline,
            return_dict_in_generate=True,
            output_logits=first_logprobs,
        )
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            generation_config=cfg,
            tokenizer=self.tokenizer,
            stopping_criteria=stop_signals(cancel),
        )
        prefill = [len(x) for x in batch]
        return self._generations(out, batch, ids.shape[1], prefill, stop_at_newline, start)

    def _generations(
        self, out, batch: list[list[int]], width: int, prefill: list[int], stop: bool, start: float
    ) -> list[Generation]:
        """One :class:`Generation` per row of a ``generate`` output whose prompts (padding
        included) are ``width`` tokens wide; ``seconds`` is the time since ``start`` / ``B``."""
        firsts = torch.log_softmax(out.logits[0].float(), dim=-1).cpu() if out.logits else None
        secs = (time.perf_counter() - start) / len(batch)
        gens = []
        for i, (row, prompt) in enumerate(
            zip(out.sequences[:, width:].tolist(), batch, strict=True)
        ):
            text, new, flags = self._decode_answer(row, stop)
            gens.append(
                Generation(
                    text=text,
                    prompt_tokens=len(prompt),
                    new_tokens=len(new),
                    token_ids=new,
                    prefill_tokens=prefill[i],
                    seconds=secs,
                    first_logprobs=None if firsts is None else firsts[i],
                    flags=list(flags),
                    reasons=flags,
                )
            )
        return gens

    def _stops(self, tok: int, stop_at_newline: bool) -> bool:
        """Whether generating ``tok`` ends a row (EOS, or a newline when asked)."""
        if tok == self.tokenizer.eos_token_id:
            return True
        return stop_at_newline and "\n" in self.tokenizer.decode([tok])

    def _collect(
        self,
        steps: Iterator[tuple[list[int], list[bool], torch.Tensor]],
        prompt_tokens: list[int],
        stop_at_newline: bool,
        first_logprobs: bool,
    ) -> list[Generation]:
        """One :class:`Generation` per row of a decoding loop's ``steps`` (:func:`greedy_steps`)
        over prompts of ``prompt_tokens`` tokens (all prefilled); ``seconds`` is the loop's time
        / ``B``."""
        start = time.perf_counter()
        pad = self.tokenizer.pad_token_id
        rows: list[list[int]] = [[] for _ in prompt_tokens]
        first = None
        for toks, alive, lps in steps:
            first = lps.cpu() if first is None else first
            for row, tok, a in zip(rows, toks, alive, strict=True):
                row.append(tok if a else pad)
        secs = (time.perf_counter() - start) / len(prompt_tokens)
        out = []
        for k, (n, row) in enumerate(zip(prompt_tokens, rows, strict=True)):
            text, new, flags = self._decode_answer(row, stop_at_newline)
            out.append(
                Generation(
                    text=text,
                    prompt_tokens=n,
                    new_tokens=len(new),
                    token_ids=new,
                    prefill_tokens=n,
                    seconds=secs,
                    first_logprobs=first[k] if first_logprobs and first is not None else None,
                    flags=list(flags),
                    reasons=flags,
                )
            )
        return out

    def _crop_reuse_cache(self, ids: list[int]) -> int:
        """Crop the KV cache kept between prefix-reusing calls (created on first use) to its
        longest common token prefix with ``ids``; return that prefix's length. The cache is then
        recorded as holding exactly those tokens, so a forward interrupted after this call never
        leaves it claiming tokens it does not hold. Every layer keeps every key
        (:func:`~ragfix.backends.family.full_cache`): a sliding-window layer could not be cropped
        back once its window is full."""
        if self._reuse_cache is None:
            self._reuse_cache = full_cache()
            self._reuse_ids = []
        common = 0
        for a, c in zip(ids, self._reuse_ids, strict=False):
            if a != c:
                break
            common += 1
        excess = self._reuse_cache.get_seq_length() - common
        if excess > 0:
            self._reuse_cache.crop(-excess)
        self._reuse_ids = ids[:common]
        return common

    @torch.no_grad()
    def _generate_reusing(
        self, ids: list[int], max_new_tokens: int, stop_at_newline: bool, cancel: Cancel | None
    ) -> Generation:
        """Greedy answer to one prompt, reusing the KV cache of the longest common token prefix
        with the previous reusing call (prompt plus answer). Greedy answers equal the batched
        path's up to floating-point differences of the shorter matmuls. ``cancel`` stops it
        between steps (the cache then holds what was computed; the caller checks it)."""
        start = time.perf_counter()
        # at least one token must be fed to get logits
        common = self._crop_reuse_cache(ids[:-1])
        inp = torch.tensor([ids], device=self.device)
        out = self.model.generate(
            input_ids=inp,
            attention_mask=torch.ones_like(inp),
            cache=self._reuse_cache,
            generation_config=self._generation_config(max_new_tokens, stop_at_newline),
            tokenizer=self.tokenizer,
            stopping_criteria=stop_signals(cancel),
        )
        seq = out[0].tolist()
        self._reuse_ids = seq[: self._reuse_cache.get_seq_length()]
        text, new, flags = self._decode_answer(seq[len(ids) :], stop_at_newline)
        return Generation(
            text=text,
            prompt_tokens=len(ids),
            new_tokens=len(new),
            token_ids=new,
            prefill_tokens=len(ids) - common,
            seconds=time.perf_counter() - start,
            flags=list(flags),
            reasons=flags,
        )

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
        """Greedy answers (see :meth:`Backend.generate`). Without ``prefix_reuse``, batches are
        formed from prompts of similar length that share a budget and stop rule. With it (where
        :attr:`supports_prefix_reuse`) the prompts run in the given order (put the cells of one
        sample together) over a KV cache kept between calls and cropped to the common prefix
        with the previous prompt: at ``batch_size`` 1 (without ``first_logprobs``) each prompt
        is prefilled and decoded alone (:meth:`_generate_reusing`); above 1, up to
        ``batch_size`` consecutive prompts are prefilled that way, then decoded in one batch
        (:meth:`_generate_trie`; its cache is ``batch_size`` rows of the longest prompt).

        Raises:
            Cancelled: ``cancel`` was set before every answer was complete.
        """
        items = [
            (self.encode(p), *answer_rules(p, max_new_tokens, stop_at_newline)) for p in prompts
        ]
        size = batch_size if self.supports_batching else 1
        if prefix_reuse and self.supports_prefix_reuse:
            if size == 1 and not first_logprobs:
                gens = []
                for item in items:
                    gens.append(self._generate_reusing(*item, cancel))
                    check_cancel(cancel)
                return gens
            order, run = list(range(len(items))), self._generate_trie
        else:
            order = sorted(range(len(items)), key=lambda i: len(items[i][0]))
            run = self.generate_ids
        results: list[Generation | None] = [None] * len(items)
        for group in batch_groups(items, order, size):
            mnt, stop = items[group[0]][1:]
            gens = run([items[j][0] for j in group], mnt, stop, first_logprobs, cancel=cancel)
            check_cancel(cancel)
            for j, g in zip(group, gens, strict=True):
                results[j] = g
        return results  # type: ignore[return-value]

    @torch.no_grad()
    def _generate_trie(
        self,
        batch: list[list[int]],
        max_new_tokens: int,
        stop_at_newline: bool,
        first_logprobs: bool = False,
        cancel: Cancel | None = None,
    ) -> list[Generation]:
        """Greedy decoding of ``B`` prompts (in the given order: a sample's sweep cells) with a
        trie-shaped prefill and one batched decode.

        Prefill: each prompt minus its last token runs over one batch-1 KV cache (kept between
        calls; every layer keeps every key, :func:`~ragfix.backends.family.full_cache`), cropped
        to the prefix it shares with the tokens the cache holds and extended by the rest; its row
        is copied, right aligned, into a cache of ``B`` rows and ``W - 1`` slots (``W``: the
        longest prompt) that the decode extends. Decode: ``model.generate`` on
        the left-padded prompts ``[B, W]`` and that cache, one batch, each row stopping at its
        own stop rule. Answers equal :meth:`generate_ids` up to floating-point differences.
        ``cancel`` stops the decode between steps (the caller checks it).

        ``Generation.prefill_tokens`` of a row: its tokens after the prefix shared with the row
        before (the first row: with the cache's previous tokens), plus one; over a depth-first
        order of the prompts' token trie each distinct prefix is computed once.

        Memory: ``B x (W + max_new_tokens)`` tokens of keys and values in every layer, sliding
        layers included (SmolLM2-135M in fp32: 45 KiB a token), besides one row's prefill cache.
        """
        start = time.perf_counter()
        slots = max(len(x) for x in batch) - 1  # the cached positions of the longest prompt
        kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> batch keys, values
        prefill = []
        for row, ids in enumerate(batch):
            body = ids[:-1]
            common = self._crop_reuse_cache(body)
            cache = self._reuse_cache
            if len(body) > common:
                pos = torch.arange(common, len(body), device=self.device)[None]
                inp = torch.tensor([body[common:]], device=self.device)
                self.model(input_ids=inp, position_ids=pos, cache=cache, logits_to_keep=1)
            self._reuse_ids = body
            prefill.append(len(body) - common + 1)
            for i, layer in enumerate(cache.layers):
                if not getattr(layer, "is_initialized", False) or layer.keys.shape[-2] == 0:
                    continue  # nothing cached yet (a one-token prompt)
                n = layer.keys.shape[-2]  # len(body)
                if i not in kv:
                    shape = (len(batch), layer.keys.shape[1], slots, layer.keys.shape[-1])
                    kv[i] = tuple(layer.keys.new_zeros(shape) for _ in range(2))
                keys, values = kv[i]
                keys[row, :, slots - n :].copy_(layer.keys[0])
                values[row, :, slots - n :].copy_(layer.values[0])
        rows = full_cache()
        for i in sorted(kv):
            rows.update(*kv.pop(i), i)
        ids, mask = self._left_pad(batch)
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            cache=rows,
            generation_config=self._generation_config(
                max_new_tokens,
                stop_at_newline,
                return_dict_in_generate=True,
                output_logits=first_logprobs,
            ),
            tokenizer=self.tokenizer,
            stopping_criteria=stop_signals(cancel),
        )
        return self._generations(out, batch, ids.shape[1], prefill, stop_at_newline, start)

    def decoder(self, prefix_reuse: bool = False) -> Decoder:
        """See :meth:`Backend.decoder`: a
        :class:`~ragfix.backends.step_decoder.StepDecoder` where
        :attr:`supports_step_decoding`, else the base's whole-``generate`` one."""
        if self.supports_step_decoding:
            return StepDecoder(self, prefix_reuse and self.supports_prefix_reuse)
        return super().decoder(prefix_reuse)

    def stream(
        self,
        prompt: Prompt,
        max_new_tokens: int = 256,
        stop_at_newline: bool = False,
        cancel: Cancel | None = None,
    ) -> Iterator[str]:
        """Yield the greedy answer to one prompt piece by piece (:meth:`stream_ids` of its
        tokens). Closing the iterator, the stop rule or ``cancel`` stops the generation thread
        at its next token.

        Raises:
            Cancelled: ``cancel`` was set before the answer was complete.
        """
        yield from self.stream_ids(self.encode(prompt), max_new_tokens, stop_at_newline, cancel)

    def stream_ids(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop_at_newline: bool,
        cancel: Cancel | None = None,
    ) -> Iterator[str]:
        """Extension point: the greedy answer to one token-id prompt, yielded piece by piece
        (a subclass that overrides :meth:`generate_ids` overrides this too, so that a streamed
        answer reads what a generated one reads).

        Raises:
            Cancelled: ``cancel`` was set before the answer was complete.
        """
        from transformers import TextIteratorStreamer

        closed = threading.Event()
        ids = torch.tensor([prompt_ids], device=self.device)
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        thread = threading.Thread(
            target=self.model.generate,
            kwargs={
                "input_ids": ids,
                "attention_mask": torch.ones_like(ids),
                "streamer": streamer,
                "generation_config": self._generation_config(max_new_tokens, stop_at_newline),
                "tokenizer": self.tokenizer,
                "stopping_criteria": stop_signals(closed, cancel),
            },
            daemon=True,
        )
        thread.start()
        try:
            yield from streamer
        finally:  # the streamer's queue is unbounded: the thread ends at its next token
            closed.set()
            thread.join()
        check_cancel(cancel)

    def _stream_steps(self, steps: Iterator[tuple[list[int], list[bool], torch.Tensor]]):
        """The text of one row's decoding ``steps`` (:func:`greedy_steps`), yielded as it grows
        (a piece once it decodes to more characters), under ``torch.no_grad``."""
        new: list[int] = []
        shown = ""
        with torch.no_grad():
            for toks, _, _ in steps:
                new.append(toks[0])
                text = self.tokenizer.decode(new, skip_special_tokens=True)
                if len(text) > len(shown):
                    yield text[len(shown) :]
                    shown = text

    # ------------------------------------------------------------------ scoring
    @torch.no_grad()
    def next_logprobs_ids(self, batch: list[list[int]]) -> torch.Tensor:
        """Extension point: float32 ``[B, vocab]`` next-token log-probabilities on the CPU, one
        left-padded forward pass with position IDs counted from each prompt's first real
        token."""
        ids, mask = self._left_pad(batch)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1)
        return torch.log_softmax(out.logits[:, -1].float(), dim=-1).cpu()

    def next_token_logprobs(self, prompts: Sequence[Prompt], *, batch_size: int = 8):
        """See :meth:`Backend.next_token_logprobs`: float32 ``[B, vocab_size]`` on the CPU."""
        encoded = [self.encode(p) for p in prompts]
        size = batch_size if self.supports_batching else 1
        parts = [
            self.next_logprobs_ids(encoded[i : i + size]) for i in range(0, len(encoded), size)
        ]
        return torch.cat(parts)

    @torch.no_grad()
    def token_scores_ids(self, ids: list[int], top: int = 0) -> TokenScores:
        """Extension point: :class:`TokenScores` of ``ids`` (``n >= 2`` tokens: ``n - 1``
        scores) with ``top`` alternatives, one forward pass."""
        x = torch.tensor([ids], device=self.device)
        logp = torch.log_softmax(self.model(input_ids=x).logits[0, :-1].float(), dim=-1)
        return TokenScores.of(logp, x[0, 1:], top)

    def _tail_logprobs(self, ids: list[int], start: int) -> torch.Tensor:
        """Float32 ``[len(ids) - 1 - start, vocab]``: the next-token log-probabilities after
        ``ids[:t + 1]`` for ``t = start .. len(ids) - 2`` (row ``i`` scores ``ids[start + 1 + i]``),
        over the prefix-reuse KV cache cropped to what it shares with ``ids[:start]``; the cache
        then holds ``ids[:-1]``. Needs ``start < len(ids) - 1``."""
        common = self._crop_reuse_cache(ids[:start])
        logits = self.model(
            input_ids=torch.tensor([ids[common:-1]], device=self.device),
            position_ids=torch.arange(common, len(ids) - 1, device=self.device)[None],
            cache=self._reuse_cache,
            logits_to_keep=len(ids) - 1 - start,
        ).logits[0]
        self._reuse_ids = ids[:-1]
        return torch.log_softmax(logits.float(), dim=-1)

    @torch.no_grad()
    def loglikelihood(self, pairs: Sequence[tuple[Prompt, str]]) -> list[float]:
        """See :meth:`Backend.loglikelihood`. Where :attr:`supports_prefix_reuse`, each pair
        runs over the prefix-reuse KV cache (the one :meth:`generate` keeps), cropped to the
        tokens it shares with the pair before and at most to its context minus one token: pairs
        of one context, given together, prefill that context once and each continuation only
        (what scoring several candidate answers under one prompt costs). Equal to the
        one-pass sum up to floating-point differences of the shorter matmuls.

        Raises:
            ValueError: an empty continuation or context.
        """
        if not self.supports_prefix_reuse:
            return super().loglikelihood(pairs)
        out = []
        for context, continuation in pairs:
            ctx, cont = self.encode(context), self.tokenize(continuation)
            if not cont or not ctx:
                raise ValueError("loglikelihood needs a non-empty context and continuation")
            ids = ctx + cont
            logp = self._tail_logprobs(ids, len(ctx) - 1)
            target = torch.tensor(cont, device=logp.device)[:, None]
            out.append(float(logp.gather(1, target).sum()))
        return out

    def token_logprobs(self, ids: Sequence[int]) -> torch.Tensor:
        """See :meth:`Backend.token_logprobs`: float32 ``[n - 1]`` on the CPU.

        Raises:
            ValueError: fewer than two tokens.
        """
        return self.token_scores(ids, 0).logprobs

    def token_scores(self, ids: Sequence[int], top: int) -> TokenScores:
        """See :meth:`Backend.token_scores` (the pass of :meth:`token_logprobs`). Where
        :attr:`supports_prefix_reuse`, consecutive calls share work (:meth:`_scores_reusing`:
        a scoring client of ``ragfix serve`` sends several continuations of one context).

        Raises:
            ValueError: fewer than two tokens.
        """
        if len(ids) < 2:
            raise ValueError("token_logprobs needs at least two tokens")
        if not self.supports_prefix_reuse:
            return self.token_scores_ids(list(ids), top)
        return self._scores_reusing(list(ids), top)

    @torch.no_grad()
    def _scores_reusing(self, ids: list[int], top: int) -> TokenScores:
        """:class:`TokenScores` of ``ids`` with the rows of the tokens it shares with the
        previous call's sequence (same ``top``) taken from that call (a row depends only on the
        tokens up to it), the others computed over the prefix-reuse KV cache (cropped to the
        prefix it shares with ``ids``); equal to one pass up to floating-point differences of
        the shorter matmuls."""
        before, scores = self._scored
        shared = 0
        if scores is not None and scores.top_ids.shape[1] == top:
            for a, b in zip(ids, before, strict=False):
                if a != b:
                    break
                shared += 1
        start = max(shared - 1, 0)  # the first row to compute (row t scores ids[t + 1])
        if start >= len(ids) - 1:
            return TokenScores(*(column[: len(ids) - 1] for column in scores))
        targets = torch.tensor(ids[start + 1 :], device=self.device)
        new = TokenScores.of(self._tail_logprobs(ids, start), targets, top)
        if start:
            new = TokenScores.cat([TokenScores(*(column[:start] for column in scores)), new])
        self._scored = (ids, new)
        return new


def batch_groups(items: list[tuple], order: list[int], size: int) -> Iterator[list[int]]:
    """Consecutive runs of ``order`` of at most ``size`` items sharing a budget and stop rule
    (``items[i] = (ids, max_new_tokens, stop_at_newline)``)."""
    i = 0
    while i < len(order):
        group = [order[i]]
        i += 1
        while i < len(order) and len(group) < size and items[order[i]][1:] == items[group[0]][1:]:
            group.append(order[i])
            i += 1
        yield group


__all__ = [
    "HFBackend",
    "batch_groups",
    "byte_level_token_bytes",
    "chat_text",
    "greedy_steps",
    "stop_signals",
    "template_id",
]
