"""The one window verdict, :meth:`Backend.fit`, on the real SmolLM2 (8192-token window), and the
consumers that act on it: the framework components' :class:`~ragfix.answering.Answerer` and the
OpenAI-compatible server (the sweep and the judge have their own tests)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import essays

from ragfix.answering import Answerer, AnswerSettings
from ragfix.backends import Fit
from ragfix.backends.base import DEFAULT_MAX_NEW_TOKENS
from ragfix.errors import ConfigError
from ragfix.prompts import TaskPrompt
from ragfix.types import CUT_TO_WINDOW, OVERFLOW

QUESTION = "What is the capital of France? Answer in one word."


def _model_count(smol, prompt: TaskPrompt) -> int:
    """The prompt's tokens counted with the tokenizer and its chat template directly."""
    tok = smol.tokenizer
    text = tok.apply_chat_template(
        [{"role": "user", "content": prompt.user}], add_generation_prompt=True, tokenize=False
    )
    return len(tok(text + prompt.assistant_prefix, add_special_tokens=False)["input_ids"])


def test_fit_of_a_prompt_that_fits_counts_what_the_model_reads(smol):
    p = TaskPrompt(user=QUESTION, max_new_tokens=3)
    f = smol.fit(p)
    assert smol.context_window == 8192
    assert f.prompt_tokens == _model_count(smol, p) and 20 < f.prompt_tokens < 60
    [gen] = smol.generate([p], max_new_tokens=1)
    assert gen.prompt_tokens == f.prompt_tokens  # the tokens the model read
    assert (f.budget, f.window) == (3, 8192)
    assert f.fits is True and f.runs and f.flag is None
    # the budget argument overrides the prompt's own, as in generate(); a plain string's own
    # budget is DEFAULT_MAX_NEW_TOKENS
    assert smol.fit(p, max_new_tokens=100).budget == 100
    s = smol.fit(QUESTION)
    assert s.budget == DEFAULT_MAX_NEW_TOKENS
    assert s.prompt_tokens == len(smol.tokenizer(QUESTION, add_special_tokens=False).input_ids)


def test_fit_at_the_limit_fits_and_one_token_more_overflows(smol):
    n = _model_count(smol, TaskPrompt(user=QUESTION))
    at = smol.fit(TaskPrompt(user=QUESTION, max_new_tokens=8192 - n))
    assert at.prompt_tokens + at.budget == at.window == 8192
    assert at.fits is True and at.runs and at.flag is None
    over = smol.fit(TaskPrompt(user=QUESTION), max_new_tokens=8192 - n + 1)
    assert over.prompt_tokens + over.budget == 8193
    assert over.fits is False and not over.runs and over.flag == OVERFLOW == "overflow"


def test_fit_of_a_prompt_longer_than_the_window(smol):
    p = TaskPrompt(user="Summarise these essays.\n\n" + essays(45_000))
    f = smol.fit(p)
    assert f.prompt_tokens == _model_count(smol, p) > 8192 and f.budget == 32
    assert f.fits is False and not f.runs and f.flag == OVERFLOW


def test_fit_of_a_backend_that_cuts_long_prompts(smol):
    from ragfix.backends.truncated import TruncatedBackend

    t = TruncatedBackend(smol.model, smol.tokenizer, train_window=64)
    assert t.cuts_long_prompts
    short = TaskPrompt(user="Hi", max_new_tokens=4)
    f = t.fit(short)
    assert f.window == 64 and f.prompt_tokens + 4 <= 64
    assert f.fits is True and f.runs and f.flag is None
    long = t.fit(TaskPrompt(user=QUESTION * 4, max_new_tokens=4))
    assert long.prompt_tokens > 64 and long.cuts_long_prompts
    assert long.fits is False and long.runs and long.flag == CUT_TO_WINDOW == "cut_to_window"


def test_fit_without_a_token_count_is_unknown_and_runs():
    f = Fit(prompt_tokens=None, budget=4, window=10)
    assert f.fits is None and f.runs and f.flag is None
    assert f.counted(6).fits is True and f.counted(7).flag == OVERFLOW
    assert Fit(None, 4, 10, cuts_long_prompts=True).counted(7).flag == CUT_TO_WINDOW
    with pytest.raises(dataclasses.FrozenInstanceError):
        f.budget = 5


def test_answerer_refuses_a_prompt_over_the_window_and_takes_one_at_it(smol):
    n = smol.fit(smol.format_prompt(TaskPrompt(user=QUESTION))).prompt_tokens
    at = Answerer(AnswerSettings(max_new_tokens=8192 - n), smol)
    assert at.model_prompt(QUESTION) == smol.format_prompt(TaskPrompt(user=QUESTION))
    over = Answerer(AnswerSettings(max_new_tokens=8192 - n + 1), smol)
    with pytest.raises(
        ConfigError,
        match=f"the prompt has {n} tokens .* num_output={8193 - n} it exceeds the 8192-token",
    ):
        over.model_prompt(QUESTION)
    assert over.calls == 0 and over.last_prompt is None


def test_server_refuses_a_prompt_over_the_window_in_openai_format(smol):
    import asyncio

    from ragfix.serve import ApiError, CompletionRequest, Server

    server = Server(smol, "smollm2")
    n = len(smol.tokenizer(QUESTION, add_special_tokens=False).input_ids)
    req = CompletionRequest(model="smollm2", prompt=QUESTION, max_tokens=8192 - n + 1)

    def check(r):
        return asyncio.run(server.check(r, r.text(), r.max_tokens))

    with pytest.raises(ApiError) as e:
        check(req)
    assert e.value.status == 400
    assert e.value.body()["error"] == {
        "message": f"This model's maximum context length is 8192 tokens; the prompt has {n} "
        f"tokens and max_tokens asks for {8193 - n}",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }
    assert check(req.model_copy(update={"max_tokens": 8192 - n})) == (n, 8192 - n)
    # no max_tokens: the server's default budget
    assert check(req.model_copy(update={"max_tokens": None})) == (n, 256)
