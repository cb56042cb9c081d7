"""ragfix: fix position bias in retrieval-augmented generation.

The LlamaIndex path in four names (``examples/quickstart.py`` runs it end to end)::

    from ragfix import RagFixLLM, RagFixPostprocessor, build_corpus, text_qa_template
    from ragfix.backends import load_backend

    index = build_corpus("docs/").index          # FAISS index, embedded MiniLM embedder, offline
    backend = load_backend("vanilla")            # the embedded SmolLM2-135M-Instruct
    engine = index.as_query_engine(
        llm=RagFixLLM(backend),
        node_postprocessors=[RagFixPostprocessor(strategy="lost-in-the-middle", backend=backend)],
        text_qa_template=text_qa_template(),
    )

* :func:`build_corpus` (:mod:`ragfix.connectors.corpus`): a folder of ``.txt``/``.md``/``.pdf``/
  ``.html`` files or a JSONL corpus, chunked, embedded and indexed (kept in the ragfix cache, keyed
  by the corpus's content and the settings; the corpus is never written); ``.index`` is the
  LlamaIndex ``VectorStoreIndex``, ``.nodes`` its chunks; with ``needles=NeedleSettings(count=N)``
  N facts are planted first and ``.needles`` lists them.
* :class:`NeedleSettings` (:mod:`ragfix.connectors.synthetic`): how needles are planted.
* :func:`embedder`: the embedded all-MiniLM-L6-v2 as a LlamaIndex embedding model (for an index
  built your own way: ``VectorStoreIndex.from_documents(docs, embed_model=embedder())``).
* :class:`RagFixPostprocessor`, :class:`RagFixLLM`, :class:`RagFixSynthesizer`,
  :func:`text_qa_template`: the LlamaIndex components (the synthesizer answers each query over
  its own chunks, with any backend).

The names are imported on first use, so ``import ragfix`` stays light.
"""

from ragfix.lazy import lazy_exports

_LAZY = {
    "RagFixPostprocessor": "ragfix.postprocessor",
    "text_qa_template": "ragfix.postprocessor",
    "RagFixLLM": "ragfix.llm",
    "RagFixSynthesizer": "ragfix.synthesizer",
    "build_corpus": "ragfix.connectors.corpus",
    "embedder": "ragfix.connectors.corpus",
    "NeedleSettings": "ragfix.connectors.synthetic",
}
__all__ = list(_LAZY)

__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
