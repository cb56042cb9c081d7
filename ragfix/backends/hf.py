"""The Hugging Face implementation of the model interface, which every local method builds on.

:class:`HFBackend` wraps a ``transformers`` causal LM and its tokenizer: batched greedy decoding
with left padding through ``generate``, batched next-token log-probabilities, rolling token
log-probabilities, streaming, and KV-cache prefix reuse. The class keeps what the model is (its
identity, text and tokens, the prefix-reuse cache); its two other jobs are its bases, each in its
own module: decoding (:class:`~ragfix.backends.decoding.HFDecoding`) and scoring
(:class:`~ragfix.backends.scoring.HFScoring`). A method changes the model (an attention
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
import warnings
from collections.abc import Sequence
from typing import ClassVar

import torch

from ragfix.backends.base import Backend, BackendOptions, Prompt, TokenScores, validated_options
from ragfix.backends.decoding import HFDecoding
from ragfix.backends.family import Family, full_cache, model_family
from ragfix.backends.scoring import HFScoring
from ragfix.models.load import model_identity
from ragfix.prompts import NO_CHAT_TEMPLATE


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


class HFBackend(HFDecoding, HFScoring, Backend):
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
    #: how a method that reads attention treats a sliding-window layer that does not see every
    #: passage (a sentence), recorded in :meth:`identity` for a model with such layers, so that
    #: a run made under another rule is not resumed; ``None``: the method reads no attention
    sliding_rule: ClassVar[str | None] = None

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
    def dtype(self) -> torch.dtype:
        """Dtype of the model's weights."""
        return next(self.model.parameters()).dtype

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
        generation settings (:func:`generation_id`), the applied adapter (if any) and, for a
        model with sliding-window layers, the method's :attr:`sliding_rule` (if any)."""
        out = {
            "model": model_identity(self.model),
            "dtype": str(self.dtype),
            "backend": self.name,
            "options": self.options.model_dump(mode="json"),
        }
        if self.sliding_rule is not None and model_family(self.model).sliding:
            out["sliding_rule"] = self.sliding_rule
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

    # ------------------------------------------------------------------ prefix reuse
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


__all__ = [
    "HFBackend",
    "byte_level_token_bytes",
    "chat_text",
    "template_id",
]
