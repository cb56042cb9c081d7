"""ragfix's correction and LLM over a backend as components of other RAG frameworks.

* :mod:`ragfix.integrations.langchain`: ``RagFixCompressor`` (a document compressor and
  transformer), ``RagFixChatModel`` (a chat model over any backend); ``pip install
  "ragfix[langchain]"``.
* :mod:`ragfix.integrations.haystack`: ``RagFixRanker`` and ``RagFixChatGenerator`` (Haystack
  components, serialisable to YAML); ``pip install "ragfix[haystack]"``.

Beside its components each framework has the engines of the pipeline sweep (``ragfix
eval-pipeline``): :class:`~ragfix.integrations.llama_index.LlamaIndexEngines`,
:class:`~ragfix.integrations.langchain.LangChainEngines`,
:class:`~ragfix.integrations.haystack.HaystackEngines`, over what they share in
:mod:`ragfix.integrations.engine`.

They are thin adapters over :mod:`ragfix.correction` and :mod:`ragfix.answering`, the same code
as the LlamaIndex components (:mod:`ragfix.postprocessor`, :mod:`ragfix.llm`), and give the same
prompt text (:func:`ragfix.tasks.render_chunk`, :func:`ragfix.tasks.join_chunks`). The core
install carries neither framework: importing a module here without its extra fails with one line
naming the extra.
"""

from __future__ import annotations

import importlib.util

from ragfix.errors import MissingExtraError

EXTRAS = {
    "langchain": ("langchain_core", "langchain_community", "langchain_classic"),
    "haystack": ("haystack",),
}
"""The top-level modules each optional extra provides."""


def require_extra(extra: str) -> None:
    """Check that the modules of an optional extra (:data:`EXTRAS`) are installed.

    Args:
        extra: the extra's name (``langchain``, ``haystack``).

    Raises:
        MissingExtraError: one is missing (one line: ``pip install "ragfix[extra]"``).
    """
    missing = [m for m in EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtraError(
            f'the {extra} integration needs {", ".join(missing)}: pip install "ragfix[{extra}]"'
        )
