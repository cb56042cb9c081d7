"""lm-evaluation-harness against ``ragfix serve`` (issue 43): its own ``local-completions`` model
class scores multiple-choice requests through a real server on 127.0.0.1 and gets what its own
``hf`` model computes from the same weights.

Offline: the server serves the session's SmolLM2 (``smol``), and lm-eval reads the same weights
and tokenizer from their local folder (:func:`ragfix.models.resolve.checkpoint_dir`), with
``HF_HUB_OFFLINE=1``.
"""

from __future__ import annotations

import pytest
from test_serve import MODEL, running

from ragfix.models.resolve import checkpoint_dir, resolve_model
from ragfix.serve import create_app

#: hand-made multiple-choice requests: (context, the choices), the right one first
QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Berlin"]),
    ("Question: What is the opposite of hot?\nAnswer:", [" cold", " blue", " a small dog"]),
    ("2 + 2 =", [" 4", " 5", " twenty-two"]),
]
#: lm-eval's ``hf`` model and the server compute the same float32 forward pass on the CPU, one
#: sequence per pass; they differ only by the order of floating-point sums (a whole sequence
#: with its continuation against lm-eval's own padded batch): 1e-4 nats per continuation
TOLERANCE = 1e-4


def test_lm_eval_local_completions_scores_as_its_hf_model(smol, monkeypatch):
    """lm-eval 0.4's ``LocalCompletionsAPI`` (``echo: true, logprobs: 1, max_tokens: 1`` for each
    loglikelihood request, ``is_greedy`` read from each continuation token's top alternative)
    against ``ragfix serve``: every (log-likelihood, is_greedy) equals lm-eval's ``HFLM`` on the
    same weights (float32, CPU) within :data:`TOLERANCE`, so the multiple-choice answers agree,
    and the right answer wins each question."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    folder = checkpoint_dir(resolve_model("smollm2"))
    requests = [
        Instance(request_type="loglikelihood", doc={}, arguments=(ctx, choice), idx=i)
        for q, (ctx, choices) in enumerate(QUESTIONS)
        for i, choice in enumerate(choices)
    ]
    with running(create_app(smol, MODEL)) as url:
        api = LocalCompletionsAPI(
            base_url=url + "/v1/completions",
            model=MODEL,
            tokenizer_backend="huggingface",
            tokenizer=folder,
            # lm-eval's default: prompts as token ids (context and continuation tokenized
            # apart), which the server scores as they are (issue 55, item 8)
            tokenized_requests=True,
            max_retries=1,
            max_length=2048,
        )
        served = api.loglikelihood(requests, disable_tqdm=True)
    hf = HFLM(pretrained=folder, device="cpu", dtype="float32", batch_size=1)
    local = hf.loglikelihood(requests, disable_tqdm=True)
    assert len(served) == len(local) == len(requests)
    for req, (lp, greedy), (ref, ref_greedy) in zip(requests, served, local, strict=True):
        assert lp == pytest.approx(ref, abs=TOLERANCE), req.arguments
        assert greedy == ref_greedy, req.arguments
    assert any(g for _, g in served) and not all(g for _, g in served)
    at = 0
    for _, choices in QUESTIONS:
        scores = [lp for lp, _ in served[at : at + len(choices)]]
        assert max(range(len(choices)), key=scores.__getitem__) == 0
        at += len(choices)
    # the same scores as the backend's own loglikelihood
    pairs = [req.arguments for req in requests]
    for (lp, _), ref in zip(served, smol.loglikelihood(pairs), strict=True):
        assert lp == pytest.approx(ref, abs=TOLERANCE)
