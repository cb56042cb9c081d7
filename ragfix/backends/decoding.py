"""Greedy decoding for :class:`~ragfix.backends.hf.HFBackend` (:class:`HFDecoding`): batched
``generate`` with left padding, prefix reuse over the backend's KV cache (one prompt at a time,
or a sample's prompts prefilled along their token trie and decoded in one batch), streaming,
and the :class:`~ragfix.backends.step_decoder.StepDecoder` ``ragfix serve`` steps; and the
decoding helpers a method with its own loop uses (:func:`greedy_steps`, :func:`stop_signals`,
:func:`batch_groups`)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from ragfix.backends.base import (
    Cancel,
    Decoder,
    Prompt,
    answer_rules,
    check_cancel,
    final_answer,
)
from ragfix.backends.family import full_cache
from ragfix.backends.step_decoder import StepDecoder
from ragfix.types import Generation


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


class HFDecoding:
    """The decoding job of :class:`~ragfix.backends.hf.HFBackend` (a base class of it, not a
    backend of its own): its methods read the backend's ``model``, ``tokenizer``, ``device``,
    :meth:`~ragfix.backends.base.Backend.encode` and prefix-reuse KV cache
    (:meth:`~ragfix.backends.hf.HFBackend._crop_reuse_cache`). :meth:`generate_ids` and
    :meth:`stream_ids` are extension points (see :class:`~ragfix.backends.hf.HFBackend`)."""

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
