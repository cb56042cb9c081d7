"""Models: names resolved to files, GGUF conversion, device and threads, loading and identity.

* :mod:`ragfix.models.resolve`: a model name (``"smollm2"``, ``"gemma3-270m"``, a ``.gguf`` file,
  a checkpoint folder, a hub id, ``openai:NAME``) to a :class:`~ragfix.models.resolve.ModelSpec`
  and its checkpoint folder, without loading anything; the installed and cached models.
* :mod:`ragfix.models.gguf`: a GGUF file checked and converted once to safetensors in the cache.
* :mod:`ragfix.models.device`: the device, the dtype and torch's CPU threads.
* :mod:`ragfix.models.load`: :func:`load_model`, :func:`load_tokenizer` and what identifies a
  loaded model's weights (:func:`model_identity`).

Content fingerprints of files and folders live in :mod:`ragfix.fingerprint`, the cache folder in
:func:`ragfix.io.cache_dir`; both names are offered here too. Every name is imported on first use
(PEP 562), so ``import ragfix.models.resolve`` or ``ragfix.models.device`` does not import torch.
"""

from ragfix.lazy import lazy_exports

_MODULES = {
    "ragfix.models.resolve": (
        "DEFAULT_EMBEDDER",
        "EMBEDDER_DIST",
        "GEMMA3",
        "GEMMA3_DIST",
        "REMOTE_PREFIX",
        "SMOLLM2",
        "SMOLLM2_DIST",
        "ModelSpec",
        "check_hub_model",
        "checkpoint_dir",
        "default_embedder_path",
        "gemma3_gguf_path",
        "installed_models",
        "load_config",
        "resolve_model",
        "smollm2_gguf_path",
        "weights_bytes",
    ),
    "ragfix.models.gguf": ("check_gguf", "converted_dir", "ensure_converted", "gguf_fingerprint"),
    "ragfix.models.device": (
        "THREADS_ENV",
        "cpu_threads",
        "free_cpu_cores",
        "resolve_device",
        "resolve_dtype",
        "usable_cpu_cores",
        "whole_number",
    ),
    "ragfix.models.load": (
        "checkpoint_files_fingerprint",
        "load_model",
        "load_tokenizer",
        "model_identity",
        "note_weights",
        "tensors_fingerprint",
        "weights_differ",
        "weights_fingerprint",
    ),
    "ragfix.fingerprint": (
        "FINGERPRINT_INDEX",
        "RECENT_NS",
        "TRAINING_STATE_FILES",
        "WEIGHT_INDEX_FILES",
        "WEIGHT_SUFFIXES",
        "content_fingerprint",
        "files_fingerprint",
        "is_weight_file",
        "weight_files_fingerprint",
    ),
    "ragfix.io": ("cache_dir",),
}
_LAZY = {name: module for module, names in _MODULES.items() for name in names}
__all__ = sorted(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
