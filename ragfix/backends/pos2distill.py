"""The ``pos2distill`` backend: the model with a Pos2Distill adapter from ``ragfix distill``.

Source: Wang et al., "Pos2Distill", arXiv 2508.15709 (training in :mod:`ragfix.distill`).

The adapter folder's ``ragfix_adapter.json`` names the base model it was trained on; loading it on
another model fails with a clear error. The adapter is applied to the weights (LoRA merged by
default), then another backend (``base``, default ``vanilla``) wraps the adapted model, so an
adapter composes with inference-time methods such as ``gali`` or ``channel-scaled``.
"""

from __future__ import annotations

from pydantic import Field

from ragfix.backends.base import Backend, BackendOptions


class Pos2DistillOptions(BackendOptions):
    """Options of the ``pos2distill`` backend.

    Attributes:
        adapter: folder written by ``ragfix distill`` (required).
        merge: merge the LoRA weights into the base weights (same speed as the base model).
            Unmerged adapters run only under the ``vanilla`` base backend.
        base: the backend that wraps the adapted model (``vanilla``, ``gali``, ...).
        base_options: that backend's options.
    """

    adapter: str
    merge: bool = True
    base: str = "vanilla"
    base_options: dict = Field(default_factory=dict)


class Pos2DistillBackend(Backend):
    """A Pos2Distill adapter applied to the model, run through another backend.

    Every generation and scoring call goes to the inner backend (``self.inner``); method-specific
    attributes of the inner backend are reachable on this object too.

    Raises (constructor):
        FileNotFoundError: the adapter folder has no ``ragfix_adapter.json``.
        ValueError: the adapter was trained on another base model, ``base`` is ``pos2distill`` or
            unknown, or ``merge=False`` with a base other than ``vanilla``.
    """

    name = "pos2distill"
    options_model = Pos2DistillOptions

    @classmethod
    def load_kwargs(cls, options: dict) -> dict:
        """The inner backend's loading needs (e.g. eager attention for GALI)."""
        from ragfix.backends import backend_class

        opts = Pos2DistillOptions(**options)
        return backend_class(opts.base).load_kwargs(opts.base_options)

    def __init__(self, model, tokenizer, **options):
        from ragfix.backends import backend_class
        from ragfix.distill import apply_adapter

        super().__init__(model, tokenizer, **options)
        opts = self.options
        if opts.base == self.name:
            raise ValueError("pos2distill cannot wrap itself: choose another base backend")
        inner_cls = backend_class(opts.base)
        if not opts.merge and opts.base != "vanilla":
            raise ValueError(
                f"an unmerged adapter runs only under the vanilla backend; use merge=true with "
                f"base={opts.base!r}"
            )
        inner_cls.options_model(**opts.base_options)  # bad inner options fail before loading
        adapted, self.metadata = apply_adapter(model, opts.adapter, merge=opts.merge)
        adapted.ragfix_name = getattr(model, "ragfix_name", model.config.name_or_path)
        self.inner = inner_cls(adapted, tokenizer, **opts.base_options)
        self.model = self.inner.model
        self.supports_prefix_reuse = self.inner.supports_prefix_reuse

    def __getattr__(self, item):
        # only called for attributes this object lacks: the inner backend's extras
        if item == "inner":
            raise AttributeError(item)
        return getattr(self.inner, item)

    @property
    def context_window(self) -> int:
        """The inner backend's window."""
        return self.inner.context_window

    def identity(self) -> dict:
        """Model identity, this backend's options, the adapter's training summary and the inner
        backend's identity."""
        out = super().identity()
        out["adapter"] = {
            k: self.metadata.get(k) for k in ("variant", "kind", "steps", "rows", "created")
        }
        out["inner"] = self.inner.identity()
        return out

    def chat_prompt(self, user: str, assistant_prefix: str = "") -> str:
        return self.inner.chat_prompt(user, assistant_prefix)

    def encode(self, prompt) -> list[int]:
        return self.inner.encode(prompt)

    def _generation_kwargs(self, max_new_tokens: int, stop_at_newline: bool) -> dict:
        return self.inner._generation_kwargs(max_new_tokens, stop_at_newline)

    def generate_ids(self, batch, max_new_tokens: int = 32, stop_at_newline: bool = True):
        """Greedy decoding through the inner backend (see :meth:`Backend.generate_ids`)."""
        return self.inner.generate_ids(batch, max_new_tokens, stop_at_newline)

    def generate(self, prompts, batch_size=8, max_new_tokens=None, stop_at_newline=None):
        """Answers through the inner backend (see :meth:`Backend.generate`)."""
        return self.inner.generate(prompts, batch_size, max_new_tokens, stop_at_newline)

    def stream(self, prompt, max_new_tokens: int = 256):
        """Streaming through the inner backend."""
        return self.inner.stream(prompt, max_new_tokens)

    def next_token_logprobs(self, prompt):
        """Next-token log-probabilities from the inner backend, float32 ``[vocab_size]``."""
        return self.inner.next_token_logprobs(prompt)
