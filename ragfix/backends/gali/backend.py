"""The ``gali`` backend: training-free context extension by Greedy Attention Logit Interpolation.

Source: Li et al., "GALI: Greedy Attention Logit Interpolation", arXiv 2502.02659 (Algorithms 1-3,
eq. 2-3) and its official code (``adlnlp/Gali``, method "dpi").

What it does, for a model trained on a window of ``L`` tokens:

* A prompt whose answer fits in ``L`` tokens runs through the unmodified model (identical logits).
* A longer one is prefilled in chunks ``[L, s, s, ..., rest]`` (Algorithm 1). Before every chunk
  and every decoding step the position IDs of the WHOLE sequence are recomputed
  (:func:`gali_positions`, Algorithm 2): the most recent tokens (at least ``local_window``) keep
  integer positions ending at ``L - 1``, older ones are squeezed with step ``1/g``, so no position
  ever leaves the trained range ``[0, L)``. Keys are cached without RoPE and re-rotated each step.
* A key at a fractional position ``p`` gets the logit linearly interpolated between the logits at
  the two integer relative distances around ``ceil(p_q) - p`` (Algorithm 3), plus Gaussian noise
  whose standard deviation grows with the token distance (seeded; ``noise=False`` turns it off).

Implementation notes (differences from the official code, same maths):

* The interpolation weight ``frac = (ceil(p_q) - p_k) mod 1 = ceil(p_k) - p_k`` depends on the key
  only, so ``A_lo + frac * (A_hi - A_lo) = q_c . ((1 - frac) k_c + frac k_f)``: the two logit
  matrices of the paper collapse into one product with an interpolated key. :func:`paper_logits`
  keeps the paper's two-matrix form as the reference the tests and the benchmark compare against.
* Attention is computed in query blocks (``query_block`` rows at a time) with grouped-query heads
  sharing their key/value head (no ``repeat_kv`` copy), so the peak memory of a layer grows
  linearly with the block, not with ``chunk x T`` per head twice.
* A sliding-window layer (Mistral) keeps its window over GALI's positions: a key is visible
  while ``ceil(p_q) - p_k < window``. Within ``L`` the positions are the token indices, so this
  is the model's own window; beyond it, the window covers more tokens where positions are
  squeezed, and no relative distance beyond the window enters a sliding layer's logits.
* Prompts of equal length are decoded as one batch (their position IDs coincide); other lengths
  run as separate groups.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from ragfix.backends.base import BackendOptions, Cancel, TokenScores, check_cancel
from ragfix.backends.decoding import greedy_steps
from ragfix.backends.family import Family, model_family, project_qkv
from ragfix.backends.gali.options import GaliOptions, default_chunk_size
from ragfix.backends.hf import HFBackend
from ragfix.backends.patching import routed
from ragfix.errors import ConfigError
from ragfix.types import Generation

#: model families whose attention module this backend knows how to replace
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "phi3")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class GaliLayout:
    """Position IDs of a whole sequence of ``T`` tokens (Algorithm 2 of the paper).

    Attributes:
        positions: float64 ``[T]``, the (possibly fractional) position of each token.
        floor: int64 ``[T]``, ``floor(positions)``.
        ceil: int64 ``[T]``, ``ceil(positions)``.
        frac: float64 ``[T]``, ``ceil - positions`` in ``[0, 1)``: the interpolation weight of the
            floor-position logit for a key at this token (0 for integer positions).
    """

    positions: torch.Tensor
    floor: torch.Tensor
    ceil: torch.Tensor
    frac: torch.Tensor

    @property
    def fractional(self) -> bool:
        """Whether any position is fractional (the sequence is longer than the window)."""
        return bool((self.frac > 0).any())


def gali_layout(total: int, train_window: int, local_window: int) -> GaliLayout:
    """Position IDs for a sequence of ``total`` tokens, with exact floors, ceilings and fractions.

    With ``T = total``, ``L = train_window``, ``W = local_window`` and ``T > L``:
    ``g = ceil((T - W) / (L - W))``, ``i = ceil((T - L) / (g - 1))``; the first ``T - (L - i)``
    tokens get ``0, 1/g, 2/g, ...`` and the last ``L - i >= W`` tokens get ``i, ..., L - 1``.
    For ``T <= L`` the positions are ``0..T-1``.

    Raises:
        ValueError: ``local_window`` not in ``[0, train_window)`` or ``total < 1``.
    """
    t, big_l, w = total, train_window, local_window
    if t < 1:
        raise ValueError(f"total must be >= 1, got {t}")
    if not 0 <= w < big_l:
        raise ValueError(f"local_window must be in [0, train_window={big_l}), got {w}")
    if t <= big_l:
        idx = torch.arange(t, dtype=torch.int64)
        return GaliLayout(idx.double(), idx, idx, torch.zeros(t, dtype=torch.float64))
    g = _ceil_div(t - w, big_l - w)
    i = _ceil_div(t - big_l, g - 1)
    k = torch.arange(t - (big_l - i), dtype=torch.int64)  # compressed head: position k / g
    tail = torch.arange(i, big_l, dtype=torch.int64)
    floor = torch.cat([torch.div(k, g, rounding_mode="floor"), tail])
    ceil = torch.cat([torch.div(k + g - 1, g, rounding_mode="floor"), tail])
    positions = torch.cat([k.double() / g, tail.double()])
    frac = torch.cat([(-k % g).double() / g, torch.zeros(len(tail), dtype=torch.float64)])
    return GaliLayout(positions, floor, ceil, frac)


def gali_positions(total: int, train_window: int, local_window: int) -> torch.Tensor:
    """Float64 ``[total]`` position IDs of a sequence (see :func:`gali_layout`).

    Example: ``gali_positions(10, 8, 2)`` is ``[0, .5, 1, 1.5, 2, 3, 4, 5, 6, 7]``.
    """
    return gali_layout(total, train_window, local_window).positions


def chunk_sizes(total: int, train_window: int, chunk_size: int) -> list[int]:
    """Prefill chunk sizes ``[L, s, s, ..., rest]`` summing to ``total`` (Algorithm 1);
    ``[total]`` when the prompt fits in the window."""
    if total <= train_window:
        return [total]
    sizes = [train_window]
    rest = total - train_window
    while rest > 0:
        sizes.append(min(chunk_size, rest))
        rest -= sizes[-1]
    return sizes


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of ``x`` ``[B, heads, T, d]`` with ``cos``/``sin`` ``[T, d]``."""
    return x * cos + _rotate_half(x) * sin


def paper_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    layout: GaliLayout,
    rotary,
    scaling: float,
    query_start: int,
) -> torch.Tensor:
    """The paper's two-matrix logit interpolation (Algorithm 3), without noise or mask: the
    reference the blocked implementation is tested and benchmarked against.

    Args:
        q: pre-RoPE queries ``[B, H, c, d]`` of tokens ``query_start .. query_start + c - 1``.
        k: pre-RoPE keys ``[B, H, T, d]`` (already repeated to ``H`` heads).
        layout: positions of all ``T`` tokens.
        rotary: the model's rotary embedding module (``forward(x, position_ids) -> cos, sin``).
        scaling: the logit scale (``head_dim ** -0.5``).
        query_start: index of the first query token in the sequence.

    Returns:
        ``[B, H, c, T]`` logits ``A_lo + frac * (A_hi - A_lo)`` with ``A_lo = q_c k_c^T``,
        ``A_hi = q_c k_f^T`` (``_c`` rotated at ``ceil`` positions, ``_f`` at ``floor``).
    """
    c = q.shape[2]
    cos_c, sin_c = rotary(q, layout.ceil[None].to(q.device))
    cos_f, sin_f = rotary(q, layout.floor[None].to(q.device))
    rows = slice(query_start, query_start + c)
    q_c = _rope(q, cos_c[0, rows], sin_c[0, rows])
    a_lo = q_c @ _rope(k, cos_c[0], sin_c[0]).transpose(-1, -2) * scaling
    a_hi = q_c @ _rope(k, cos_f[0], sin_f[0]).transpose(-1, -2) * scaling
    ceil_q = layout.ceil[rows].to(q.device, q.dtype)[:, None]
    frac = torch.remainder(ceil_q - layout.positions.to(q.device, q.dtype)[None, :], 1.0)
    return a_lo + frac * (a_hi - a_lo)


class _GaliRun:
    """State of one GALI prefill/decode run over a batch of equal-length sequences: the pre-RoPE
    KV cache of every layer and the RoPE tables of the current step."""

    def __init__(self, backend: GaliBackend):
        self.b = backend
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self.done = 0  # tokens already in the cache
        self.generator = torch.Generator(device=backend.device).manual_seed(backend.options.seed)

    def _tables(self, layout: GaliLayout, dtype):
        rotary = self.b.rotary
        dev = self.b.device
        probe = torch.empty(0, device=dev, dtype=dtype)
        cos_c, sin_c = rotary(probe, layout.ceil[None].to(dev))
        if not layout.fractional:
            return cos_c[0], sin_c[0], None, None
        cos_f, sin_f = rotary(probe, layout.floor[None].to(dev))
        return cos_c[0], sin_c[0], cos_f[0], sin_f[0]

    def begin(self, chunk: int) -> None:
        """Prepare a step that adds ``chunk`` tokens: positions of the whole sequence, RoPE tables
        at their ceilings (and floors when fractional), the interpolation weights."""
        total = self.done + chunk
        opts = self.b.options_resolved
        self.layout = gali_layout(total, opts["train_window"], opts["local_window"])
        dtype = self.b.model.dtype
        self.cos_c, self.sin_c, self.cos_f, self.sin_f = self._tables(self.layout, dtype)
        self.frac = self.layout.frac.to(self.b.device, dtype)
        self.ceil = self.layout.ceil.to(self.b.device)
        self.positions = self.layout.positions.to(self.b.device)
        self.start = self.done

    @torch.no_grad()
    def step(self, ids: torch.Tensor, logits_to_keep: int = 1) -> torch.Tensor:
        """Feed ``ids`` ``[B, c]`` (a prefill chunk or one decoded token) with positions
        recomputed for the whole sequence; return logits ``[B, kept, vocab]``."""
        self.begin(ids.shape[1])
        out = self.b.model(input_ids=ids, use_cache=False, logits_to_keep=logits_to_keep)
        self.done += ids.shape[1]
        return out.logits

    def keys_at(self, k: torch.Tensor) -> torch.Tensor:
        """Rotated keys ``[B, Hkv, T, d]``: RoPE at the ceiling positions, interpolated towards
        the floor positions by ``frac`` (the one-matrix form of the logit interpolation)."""
        k_c = _rope(k, self.cos_c, self.sin_c)
        if self.cos_f is None:
            return k_c
        k_f = _rope(k, self.cos_f, self.sin_f)
        return torch.lerp(k_c, k_f, self.frac[:, None])

    def attend(self, attn, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of the step's queries over all cached keys, in query blocks.

        Args:
            attn: the model's attention module of this layer (for ``scaling`` and head counts).
            q: pre-RoPE queries ``[B, H, c, d]``; k, v: pre-RoPE keys / values ``[B, Hkv, T, d]``.

        Returns:
            ``[B, c, H * d]`` attention output (before ``o_proj``).
        """
        bsz, heads, c, d = q.shape
        kv_heads, total = k.shape[1], k.shape[2]
        groups = heads // kv_heads
        rows = slice(self.start, self.start + c)
        q = _rope(q, self.cos_c[rows], self.sin_c[rows]).view(bsz, kv_heads, groups, c, d)
        k_t = self.keys_at(k).transpose(-1, -2)  # [B, Hkv, d, T]
        opts = self.b.options
        window = self.b.windows[attn.layer_idx]
        noisy = opts.noise and opts.noise_std > 0 and self.cos_f is not None
        key_idx = torch.arange(total, device=q.device)
        if noisy:
            # noise only where the key's position is fractional (paper: where frac != 0)
            noise_keys = (self.frac > 0).to(q.dtype)
        block = opts.query_block or c
        out = torch.empty(bsz, kv_heads, groups, c, d, device=q.device, dtype=q.dtype)
        for r0 in range(0, c, block):
            r1 = min(c, r0 + block)
            n = r1 - r0
            qb = q[:, :, :, r0:r1].reshape(bsz, kv_heads, groups * n, d)
            logits = (qb @ k_t).view(bsz, kv_heads, groups, n, total).mul_(attn.scaling)
            query_idx = torch.arange(self.start + r0, self.start + r1, device=q.device)
            if noisy:
                # sigma[m, n] = noise_std * (m - n) / T with token indices m (query), n (key)
                sigma = (query_idx[:, None] - key_idx[None, :]).clamp_(min=0).to(q.dtype)
                sigma.mul_(opts.noise_std / total).mul_(noise_keys)
                # one draw for the whole batch: every row gets the noise it would get alone, so
                # a prompt's answer does not depend on its batch mates
                eps = torch.randn(
                    (1, *logits.shape[1:]), generator=self.generator, device=q.device, dtype=q.dtype
                )
                logits.add_(eps.mul_(sigma))
            hidden = key_idx[None, :] > query_idx[:, None]  # [n, T] bottom-right causal mask
            if window is not None:
                # a sliding layer sees a key while its distance ceil(p_q) - p_k < window
                hidden |= self.ceil[query_idx, None] - self.positions[None, :] >= window
            logits.masked_fill_(hidden, float("-inf"))
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32).to(v.dtype)
            out[:, :, :, r0:r1] = (
                probs.view(bsz, kv_heads, groups * n, total)
                .matmul(v)
                .view(bsz, kv_heads, groups, n, d)
            )
        return out.view(bsz, heads, c, d).transpose(1, 2).reshape(bsz, c, heads * d)


def _gali_attention_forward(attn, run: _GaliRun, hidden_states, *args, **kwargs):
    """Replacement ``forward`` of a Llama/Mistral/Qwen2/Qwen3 attention module during a GALI
    run: projects q/k/v (with Qwen3's q/k norms), caches the pre-RoPE keys and values in ``run``
    and attends with interpolated logits. Returns ``(output [B, c, hidden], None)``."""
    q, k, v = project_qkv(attn, hidden_states)
    i = attn.layer_idx
    if i in run.keys:
        k = torch.cat([run.keys[i], k], dim=2)
        v = torch.cat([run.values[i], v], dim=2)
    run.keys[i], run.values[i] = k, v
    return attn.o_proj(run.attend(attn, q, k, v)), None


class GaliBackend(HFBackend):
    """Greedy Attention Logit Interpolation (arXiv 2502.02659) over an unmodified model.

    Raises (constructor):
        ValueError: an unsupported model family, ``train_window`` above the model's trained
            window, ``local_window >= train_window`` or ``target_window < train_window``.
    """

    name = "gali"
    options_model = GaliOptions
    supports_prefix_reuse = False
    supports_step_decoding = False  # its own decoding loop beyond the window

    @classmethod
    def check_family(cls, family: Family, options: BackendOptions) -> None:
        """GALI runs on one RoPE base over whole heads (see the module docstring).

        Raises:
            UnsupportedModelError: a family outside :data:`SUPPORTED_MODEL_TYPES` or partial
                rotary.
        """
        if family.model_type not in SUPPORTED_MODEL_TYPES:
            raise family.refuse(
                "gali",
                "its interpolated attention logits are written for one RoPE base over whole "
                f"heads (families: {', '.join(SUPPORTED_MODEL_TYPES)})",
            )
        if family.partial_rotary < 1:
            raise family.refuse("gali", "RoPE rotates only part of each head")

    def __init__(self, model, tokenizer, *, adapter: dict | None = None, **options):
        super().__init__(model, tokenizer, adapter=adapter, **options)
        cfg = model.config
        o = self.options
        native = int(cfg.max_position_embeddings)
        big_l = o.train_window or native
        if big_l > native:
            raise ConfigError(f"train_window {big_l} exceeds the model's trained window {native}")
        chunk = o.chunk_size or default_chunk_size(big_l)
        resolved = {
            "train_window": big_l,
            "target_window": o.target_window or 4 * big_l,
            "chunk_size": chunk,
            "local_window": o.local_window if o.local_window is not None else min(chunk, big_l - 1),
        }
        if resolved["local_window"] >= big_l:
            raise ConfigError(
                f"local_window {resolved['local_window']} must be < train_window {big_l}"
            )
        if resolved["target_window"] < big_l:
            raise ConfigError(f"target_window {resolved['target_window']} < train_window {big_l}")
        self.options_resolved = resolved
        decoder = model.get_decoder()
        self.rotary = decoder.rotary_emb
        self.attentions = [layer.self_attn for layer in decoder.layers]
        self.windows = model_family(model).windows

    @property
    def train_window(self) -> int:
        """``L``: prompts (plus answer) up to this many tokens run as the unmodified model."""
        return self.options_resolved["train_window"]

    @property
    def context_window(self) -> int:
        """The extended window (``target_window``), used as the token budget for passages."""
        return self.options_resolved["target_window"]

    def identity(self) -> dict:
        """Model identity, backend name and the resolved options (defaults filled in)."""
        ident = super().identity()
        ident["options"] = {**ident["options"], **self.options_resolved}
        return ident

    # ------------------------------------------------------------------ the GALI loop
    def _patched(self, run: _GaliRun):
        """Route every attention module through GALI for the duration of ``run``
        (:func:`~ragfix.backends.patching.routed`).

        Raises:
            IncompatibleMethodsError: another method already patches the attention.
        """
        return routed("gali", self.attentions, _gali_attention_forward, run)

    def _prefill(self, run: _GaliRun, ids: torch.Tensor, logits_to_keep: int) -> Iterator:
        """Feed ``ids`` ``[B, n]`` chunk by chunk; yield each chunk's logits."""
        o = self.options_resolved
        start = 0
        for size in chunk_sizes(ids.shape[1], o["train_window"], o["chunk_size"]):
            yield run.step(ids[:, start : start + size], logits_to_keep)
            start += size

    @torch.no_grad()
    def token_logprobs_with_positions(
        self, ids: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probabilities under GALI and the position ID of the query each token was
        predicted from.

        Token ``t`` is predicted from the query of token ``t - 1``, computed in the prefill chunk
        that holds it, at that chunk's position of ``t - 1`` (:func:`gali_layout` of the sequence
        up to the chunk's end, Algorithms 1-2 of arXiv 2502.02659). A fractional position is an
        interpolated query (rotated at its ceiling ``ceil(p_q)``, Algorithm 3); within the window
        every position is a whole number.

        Args:
            ids: one token sequence of length ``n >= 2``.

        Returns:
            ``(logprobs, positions)``: float32 ``[n - 1]`` ``log p(ids[t] | ids[:t])`` and float64
            ``[n - 1]`` query positions for ``t = 1..n-1``, both on the CPU.

        Raises:
            ValueError: fewer than two tokens.
        """
        if len(ids) < 2:
            raise ValueError("token_logprobs needs at least two tokens")
        scores, positions = self._scores_with_positions(list(ids), 0)
        return scores.logprobs, positions

    @torch.no_grad()
    def _scores_with_positions(self, ids: list[int], top: int) -> tuple[TokenScores, torch.Tensor]:
        """:class:`TokenScores` of ``ids`` under GALI with ``top`` alternatives, and the query
        positions of :meth:`token_logprobs_with_positions`."""
        x = torch.tensor([ids], device=self.device)
        run = _GaliRun(self)
        parts, positions = [], []
        with self._patched(run):
            for logits in self._prefill(run, x, logits_to_keep=0):
                parts.append(torch.log_softmax(logits[0].float(), dim=-1))
                positions.append(run.layout.positions[run.start : run.done])
        logp = torch.cat(parts)[:-1]
        return TokenScores.of(logp, x[0, 1:], top), torch.cat(positions)[:-1]

    def token_scores_ids(self, ids: list[int], top: int = 0) -> TokenScores:
        """:class:`TokenScores` of ``ids`` under GALI (rows ``t = 1..n-1``)."""
        return self._scores_with_positions(ids, top)[0]

    @torch.no_grad()
    def next_logprobs_ids(self, batch: list[list[int]]) -> torch.Tensor:
        """``[B, vocab]`` next-token log-probabilities: the unmodified model (batched) for
        prompts within the trained window, GALI prefill (one prompt at a time) beyond it."""
        out: list[torch.Tensor | None] = [None] * len(batch)
        inside = [i for i, x in enumerate(batch) if len(x) <= self.train_window]
        if inside:
            lps = super().next_logprobs_ids([batch[i] for i in inside])
            for i, lp in zip(inside, lps, strict=True):
                out[i] = lp
        for i, x in enumerate(batch):
            if out[i] is None:
                out[i] = torch.log_softmax(self.prefill_logits(x).float(), dim=-1).cpu()
        return torch.stack(out)  # type: ignore[arg-type]

    @torch.no_grad()
    def prefill_logits(self, ids: Sequence[int]) -> torch.Tensor:
        """GALI's chunked prefill of one prompt at any length (within the window too: one chunk
        at whole-number positions); the next-token logits ``[vocab_size]`` on the model's device
        and dtype (what ``bench/gali.py`` times)."""
        run = _GaliRun(self)
        with self._patched(run):
            *_, logits = self._prefill(run, torch.tensor([list(ids)], device=self.device), 1)
        return logits[0, -1]

    def _greedy(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        stop_at_newline: bool,
        cancel: Cancel | None = None,
    ) -> Iterator:
        """Greedy GALI decoding of ``ids`` ``[B, n]`` (equal lengths): the steps of
        :func:`~ragfix.backends.decoding.greedy_steps` over GALI's prefill and cached steps
        (``cancel`` ends them between steps)."""
        run = _GaliRun(self)
        with self._patched(run):
            *_, logits = self._prefill(run, ids, 1)
            yield from greedy_steps(
                logits,
                lambda nxt: run.step(nxt, 1),
                max_new_tokens,
                lambda t: self._stops(t, stop_at_newline),
                cancel,
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
        """Greedy decoding of ``B`` token-id prompts.

        Prompts whose answer fits in the trained window run through the unmodified model
        (batched); the others run GALI, one batch per prompt length (equal lengths share their
        position IDs). ``seconds`` is each group's time / its size. ``cancel`` stops decoding
        between steps (the caller checks it; no further group starts).
        """
        results: list[Generation | None] = [None] * len(batch)
        inside = [i for i, x in enumerate(batch) if len(x) + max_new_tokens <= self.train_window]
        if inside:
            gens = super().generate_ids(
                [batch[i] for i in inside], max_new_tokens, stop_at_newline, first_logprobs, cancel
            )
            for i, g in zip(inside, gens, strict=True):
                results[i] = g
        groups: dict[int, list[int]] = {}
        for i, x in enumerate(batch):
            if results[i] is None:
                groups.setdefault(len(x), []).append(i)
        for members in groups.values():
            check_cancel(cancel)
            ids = torch.tensor([batch[i] for i in members], device=self.device)
            steps = self._greedy(ids, max_new_tokens, stop_at_newline, cancel)
            lens = [len(batch[i]) for i in members]
            gens = self._collect(steps, lens, stop_at_newline, first_logprobs)
            for i, g in zip(members, gens, strict=True):
                results[i] = g
        return results  # type: ignore[return-value]

    def stream_ids(
        self,
        prompt_ids: list[int],
        max_new_tokens: int,
        stop_at_newline: bool,
        cancel: Cancel | None = None,
    ) -> Iterator[str]:
        """Yield the answer to one token-id prompt piece by piece (greedy; GALI beyond the
        window); closing the iterator or ``cancel`` stops decoding at once.

        Raises:
            Cancelled: ``cancel`` was set before the answer was complete.
        """
        if len(prompt_ids) + max_new_tokens <= self.train_window:
            yield from super().stream_ids(prompt_ids, max_new_tokens, stop_at_newline, cancel)
            return
        x = torch.tensor([prompt_ids], device=self.device)
        yield from self._stream_steps(self._greedy(x, max_new_tokens, stop_at_newline, cancel))
        check_cancel(cancel)


__all__ = [
    "GaliBackend",
    "GaliLayout",
    "chunk_sizes",
    "gali_layout",
    "gali_positions",
    "paper_logits",
]
