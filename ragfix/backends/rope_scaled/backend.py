"""The ``rope-scaled`` backend: transformers' own RoPE scaling, the baselines GALI is compared to.

Each variant rebuilds the model's rotary embedding from a copy of its config with
``rope_parameters`` set for a window of ``train_window`` tokens stretched ``factor`` times:

* ``linear``: position interpolation, positions divided by ``factor`` (Chen et al., arXiv
  2306.15595);
* ``dynamic``: dynamic NTK scaling, the RoPE base grows with the sequence length once it exceeds
  ``train_window`` (bloc97's "Dynamically Scaled RoPE", used by transformers' ``dynamic`` type);
* ``yarn``: YaRN, per-frequency interpolation plus attention temperature (Peng et al., arXiv
  2309.00071).

The settings follow GALI's baselines (arXiv 2502.02659, Table 10: factor = target / trained
window). The weights are untouched; only cos/sin change, so generation goes through the shared
path of :class:`~ragfix.backends.hf.HFBackend` (dynamic NTK one prompt at a time: its RoPE
base depends on the batch's longest sequence).
"""

from __future__ import annotations

import copy

from ragfix.backends.base import BackendOptions
from ragfix.backends.family import Family
from ragfix.backends.hf import HFBackend
from ragfix.backends.rope_scaled.options import RopeScaledOptions
from ragfix.errors import ConfigError


class RopeScaledBackend(HFBackend):
    """The model with a transformers RoPE-scaling variant at ``factor`` x its trained window.

    Raises (constructor):
        ValueError: the model has no ``rotary_emb`` or uses a non-default RoPE already.
    """

    name = "rope-scaled"
    options_model = RopeScaledOptions

    @classmethod
    def check_family(cls, family: Family, options: BackendOptions) -> None:
        """One set of RoPE parameters is rewritten.

        Raises:
            UnsupportedModelError: layers with RoPE parameters of their own (Gemma 3's local and
                global bases), where a rewritten top-level set would change nothing.
        """
        if family.layer_rope:
            raise family.refuse(
                "rope-scaled",
                "its local and global layers have RoPE parameters of their own, and rope-scaled "
                "rewrites one set",
            )

    def __init__(self, model, tokenizer, *, adapter: dict | None = None, **options):
        super().__init__(model, tokenizer, adapter=adapter, **options)
        o = self.options
        decoder = model.get_decoder()
        rotary = getattr(decoder, "rotary_emb", None)
        if rotary is None:
            raise ConfigError(f"{model.config.model_type} has no rotary embedding to scale")
        params = dict(model.config.rope_parameters or {})
        if params.get("rope_type", "default") != "default":
            raise ConfigError(
                f"the model already uses rope_type {params['rope_type']!r}; rope-scaled starts "
                "from plain RoPE"
            )
        self.train_window = o.train_window or int(model.config.max_position_embeddings)
        cfg = copy.deepcopy(model.config)
        cfg.max_position_embeddings = self.train_window
        cfg.rope_parameters = {
            **params,
            "rope_type": o.rope_type,
            "factor": o.factor,
            "original_max_position_embeddings": self.train_window,
        }
        decoder.rotary_emb = type(rotary)(config=cfg).to(self.device)
        # dynamic NTK picks its RoPE base from the longest sequence of the batch, so a prompt's
        # answer would depend on its batch mates: run one prompt at a time
        self.supports_batching = o.rope_type != "dynamic"
        # and from the length of the whole cached sequence: a reused prefix was rotated for
        # another length
        self.supports_prefix_reuse = o.rope_type != "dynamic"
        self.supports_step_decoding = o.rope_type != "dynamic"

    @property
    def context_window(self) -> int:
        """``factor * train_window`` tokens."""
        return int(self.options.factor * self.train_window)

    def identity(self) -> dict:
        """Model identity, backend name and the options, ``train_window`` resolved."""
        ident = super().identity()
        ident["options"] = {**ident["options"], "train_window": self.train_window}
        return ident
