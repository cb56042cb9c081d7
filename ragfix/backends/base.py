"""The Backend interface every model backend fills, and the shared generation path.

A backend is a causal LM plus what a method changes in it (the ``vanilla`` backend changes
nothing). All backends share one loading path (:func:`ragfix.models.load_model`) and, unless a
method needs its own decoding loop, one generation path: batched greedy decoding with left padding
through transformers' ``generate``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from threading import Thread
from typing import ClassVar

import torch
from pydantic import BaseModel, ConfigDict

from ragfix.models import model_identity
from ragfix.prompts import TaskPrompt
from ragfix.types import Generation


class BackendOptions(BaseModel):
    """Settings of a backend (none for vanilla). Subclasses add their method's fields."""

    model_config = ConfigDict(extra="forbid")


class Backend:
    """A causal LM ready to answer prompts.

    Attributes:
        name: registry name of the backend (``"vanilla"``, ``"channel-scaled"`` ...).
        model: the (possibly patched) ``transformers`` causal LM, in eval mode.
        tokenizer: its tokenizer (left padding).
        options: the validated backend options.
        supports_prefix_reuse: whether a KV cache computed for a prompt prefix may be cropped and
            reused for another prompt with the same prefix (used by the sweep).

    Raises (constructor):
        pydantic.ValidationError: an unknown or invalid option.
    """

    name: ClassVar[str] = "vanilla"
    options_model: ClassVar[type[BackendOptions]] = BackendOptions
    supports_prefix_reuse: ClassVar[bool] = True

    @classmethod
    def load_kwargs(cls, options: dict) -> dict:
        """Extra keyword arguments for :func:`ragfix.models.load_model` (e.g. an attention
        implementation the method needs). None for most backends."""
        return {}

    def __init__(self, model, tokenizer, **options):
        self.model = model
        self.tokenizer = tokenizer
        self.options = self.options_model(**options)

    # ------------------------------------------------------------------ properties
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
        """Tokens the backend can read (prompt plus answer): the model's trained window, or the
        extended window of a context-extension backend."""
        return int(self.model.config.max_position_embeddings)

    def identity(self) -> dict:
        """Model identity plus backend name and options: what makes two results comparable."""
        return {
            "model": model_identity(self.model),
            "backend": self.name,
            "options": self.options.model_dump(mode="json"),
        }

    # ------------------------------------------------------------------ prompts
    def chat_prompt(self, user: str, assistant_prefix: str = "") -> str:
        """``user`` wrapped in the model's chat template (when it has one), with the assistant
        turn opened and prefilled with ``assistant_prefix``."""
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": user}], add_generation_prompt=True, tokenize=False
            )
        else:
            text = user + "\n"
        return text + assistant_prefix

    def encode(self, prompt: TaskPrompt | str) -> list[int]:
        """Token ids of a prompt (a :class:`TaskPrompt` is chat-formatted first). No special
        tokens are added: the chat template carries them."""
        if isinstance(prompt, TaskPrompt):
            prompt = self.chat_prompt(prompt.user, prompt.assistant_prefix)
        return self.tokenizer(prompt, add_special_tokens=False)["input_ids"]

    def count_tokens(self, text: str) -> int:
        """Number of tokens of ``text`` (no special tokens)."""
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    # ------------------------------------------------------------------ generation
    def _generation_kwargs(self, max_new_tokens: int, stop_at_newline: bool) -> dict:
        from transformers import GenerationConfig

        cfg = GenerationConfig(
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=self.tokenizer.eos_token_id,
            pad_token_id=self.tokenizer.pad_token_id,
            stop_strings=["\n"] if stop_at_newline else None,
        )
        return {"generation_config": cfg, "tokenizer": self.tokenizer}

    def _decode(self, new_ids: Sequence[int], stop_at_newline: bool) -> tuple[str, int]:
        ids = [i for i in new_ids if i != self.tokenizer.pad_token_id]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if stop_at_newline:
            text = text.strip().split("\n")[0]
        return text.strip(), len(ids)

    @torch.no_grad()
    def generate_ids(
        self,
        batch: list[list[int]],
        max_new_tokens: int = 32,
        stop_at_newline: bool = True,
    ) -> list[Generation]:
        """Greedy decoding of a batch of token-id prompts (left padded to one tensor).

        Args:
            batch: ``B`` prompts as token-id lists (lengths may differ).
            max_new_tokens: generation budget per prompt.
            stop_at_newline: stop each row at its first newline (the text is cut there).

        Returns:
            ``B`` :class:`Generation` objects, in order; ``seconds`` is the batch time / ``B``.
        """
        start = time.perf_counter()
        width = max(len(x) for x in batch)
        pad = self.tokenizer.pad_token_id
        ids = torch.tensor([[pad] * (width - len(x)) + x for x in batch], device=self.device)
        mask = torch.tensor(
            [[0] * (width - len(x)) + [1] * len(x) for x in batch], device=self.device
        )
        out = self.model.generate(
            input_ids=ids,
            attention_mask=mask,
            **self._generation_kwargs(max_new_tokens, stop_at_newline),
        )
        secs = (time.perf_counter() - start) / len(batch)
        gens = []
        for row, prompt in zip(out[:, width:].tolist(), batch, strict=True):
            text, n_new = self._decode(row, stop_at_newline)
            gens.append(
                Generation(
                    text=text,
                    prompt_tokens=len(prompt),
                    new_tokens=n_new,
                    prefill_tokens=len(prompt),
                    seconds=secs,
                )
            )
        return gens

    def generate(
        self,
        prompts: Sequence[TaskPrompt | str],
        batch_size: int = 8,
        max_new_tokens: int | None = None,
        stop_at_newline: bool | None = None,
    ) -> list[Generation]:
        """Answer ``prompts`` greedily, in batches of ``batch_size`` (sorted by length to limit
        padding). Plain strings are used as they are (no chat template); a :class:`TaskPrompt`
        brings its own budget and stop rule unless overridden here.

        Returns:
            one :class:`Generation` per prompt, in the input order.
        """
        items = []
        for p in prompts:
            if isinstance(p, TaskPrompt):
                mnt = max_new_tokens or p.max_new_tokens
                stop = p.stop_at_newline if stop_at_newline is None else stop_at_newline
            else:
                mnt = max_new_tokens or 32
                stop = True if stop_at_newline is None else stop_at_newline
            items.append((self.encode(p), mnt, stop))
        order = sorted(range(len(items)), key=lambda i: len(items[i][0]))
        results: list[Generation | None] = [None] * len(items)
        i = 0
        while i < len(order):
            # a batch shares one budget and stop rule
            _, mnt, stop = items[order[i]]
            group = [order[i]]
            i += 1
            while i < len(order) and len(group) < batch_size and items[order[i]][1:] == (mnt, stop):
                group.append(order[i])
                i += 1
            for j, g in zip(
                group, self.generate_ids([items[j][0] for j in group], mnt, stop), strict=True
            ):
                results[j] = g
        return results  # type: ignore[return-value]

    def stream(self, prompt: TaskPrompt | str, max_new_tokens: int = 256) -> Iterator[str]:
        """Yield the answer to one prompt piece by piece as it is generated (greedy)."""
        from transformers import TextIteratorStreamer

        ids = torch.tensor([self.encode(prompt)], device=self.device)
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        kwargs = self._generation_kwargs(max_new_tokens, stop_at_newline=False)
        thread = Thread(
            target=self.model.generate,
            kwargs={"input_ids": ids, "streamer": streamer, **kwargs},
        )
        thread.start()
        yield from streamer
        thread.join()

    @torch.no_grad()
    def next_token_logprobs(self, prompt: TaskPrompt | str) -> torch.Tensor:
        """Log-probabilities of the next token after ``prompt``.

        Returns:
            float32 tensor of shape ``[vocab_size]`` on the CPU.
        """
        ids = torch.tensor([self.encode(prompt)], device=self.device)
        logits = self.model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
        return torch.log_softmax(logits, dim=-1).cpu()


class PrefixReuser:
    """Generates for a sequence of prompts that share prefixes, reusing the KV cache.

    Each call crops the cache to the longest common token prefix with the previous call's tokens
    (prompt plus generated) and prefills only the rest. Greedy answers equal naive decoding up to
    floating-point differences of the shorter matmuls. Batch size 1.

    Raises:
        ValueError: the backend does not allow prefix reuse.
    """

    def __init__(self, backend: Backend):
        if not backend.supports_prefix_reuse:
            raise ValueError(f"backend {backend.name!r} does not allow KV-cache prefix reuse")
        from transformers import DynamicCache

        self.backend = backend
        self.cache = DynamicCache(config=backend.model.config)
        self.cached_ids: list[int] = []

    @torch.no_grad()
    def generate(self, ids: list[int], max_new_tokens: int, stop_at_newline: bool) -> Generation:
        """Greedy answer to one token-id prompt, reusing the cached prefix."""
        b = self.backend
        start = time.perf_counter()
        common = 0
        for a, c in zip(ids, self.cached_ids, strict=False):
            if a != c:
                break
            common += 1
        common = min(common, len(ids) - 1)  # at least one token must be fed to get logits
        excess = self.cache.get_seq_length() - common
        if excess > 0:
            self.cache.crop(-excess)
        inp = torch.tensor([ids], device=b.device)
        out = b.model.generate(
            input_ids=inp,
            attention_mask=torch.ones_like(inp),
            cache=self.cache,
            **b._generation_kwargs(max_new_tokens, stop_at_newline),
        )
        seq = out[0].tolist()
        self.cached_ids = seq[: self.cache.get_seq_length()]
        text, n_new = b._decode(seq[len(ids) :], stop_at_newline)
        return Generation(
            text=text,
            prompt_tokens=len(ids),
            new_tokens=n_new,
            prefill_tokens=len(ids) - common,
            seconds=time.perf_counter() - start,
        )
