"""Calibration for the channel-scaled backend: screening finds a planted positional channel, the
shared-prefix loss equals the full teacher-forced loss, the KV calibration prompts, the artefact,
and an end-to-end run on a tiny model with the real SmolLM2 tokenizer."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch
from conftest import data_file, tiny_model
from typer.testing import CliRunner

from ragfix.backends.channel_scaling import (
    ChannelScalingBackend,
    ChannelScalingCalibration,
    SettingScore,
    apply_channel_scaling,
)
from ragfix.backends.channel_scaling.calibrate import (
    CalibrationPrompt,
    CalibrationSettings,
    _split,
    calibrate,
    calibration_prompts,
    calibration_table,
    example_losses,
    kv_calibration_examples,
    mean_hidden_states,
    qa_calibration_examples,
    random_text_ids,
    score_setting,
    screen_channels,
    select,
)
from ragfix.backends.hf import HFBackend
from ragfix.errors import ConfigError, DataError
from ragfix.fingerprint import content_fingerprint


def test_screen_finds_a_planted_positional_channel():
    m = tiny_model("llama", seed=0, num_hidden_layers=8)
    ids = torch.randint(3, 256, (4, 120), generator=torch.Generator().manual_seed(0))
    mean = mean_hidden_states(m, ids, batch_size=2, progress=False)[1:].numpy().copy()
    assert mean.shape == (8, 120, 64)
    planted = 37
    ramp = 20 * mean.std() * np.sqrt(np.arange(1, 121) / 120.0)  # rises smoothly with position
    mean[:, :, planted] += ramp
    cands = screen_channels(mean, mono_skip=36, smooth_skip=24, top_k=5)
    assert cands[0].channel == planted
    assert cands[0].monotone_layers == [2, 3, 4, 5, 6]
    assert [c.smoothness for c in cands] == sorted(c.smoothness for c in cands)
    # without the plant the channel is not the smoothest positional one
    mean[:, :, planted] -= ramp
    assert all(c.channel != planted for c in screen_channels(mean, 36, 24, top_k=1))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_shared_prefix_loss_equals_full_teacher_forcing(arch, attn):
    m = tiny_model(arch, seed=1, attn=attn, num_hidden_layers=4)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 256, (30,), generator=g).tolist()
    answer = torch.randint(3, 256, (5,), generator=g).tolist()
    settings = [(0, 1.0), (7, 0.0), (7, -1.0)]
    got = example_losses(m, prompt, answer, [1, 2], settings)
    ids = torch.tensor([prompt + answer])
    labels = ids.clone()
    labels[0, : len(prompt)] = -100
    with torch.no_grad():
        vanilla = m(input_ids=ids, labels=labels, use_cache=False).loss.item()
        full = []
        for channel, factor in settings:
            with apply_channel_scaling(m, channel, [1, 2], factor, rows=len(answer) + 1):
                full.append(m(input_ids=ids, labels=labels, use_cache=False).loss.item())
    np.testing.assert_allclose(got, full, rtol=1e-5)
    assert got[0] == pytest.approx(vanilla, rel=1e-5)
    assert got[1] != pytest.approx(got[0], rel=1e-6)


def test_kv_calibration_prompts_put_the_gold_pair_at_the_depths(smol):
    examples = kv_calibration_examples(smol, examples=3, pairs=8, seed=3)
    for e, depth in zip(examples, [2, 4, 6], strict=True):
        assert (e.task, e.depth) == ("kv", depth)
        text = smol.detokenize(e.prompt_ids)
        value = smol.detokenize(e.answer_ids)
        pair_lines = [line for line in text.splitlines() if '": "' in line]
        assert len(pair_lines) == 8
        assert value in pair_lines[depth]
        # the bare value follows the generation prompt, as in the official calibration set
        assert text.endswith("Corresponding value:\nassistant\n")  # special tokens dropped
    assert kv_calibration_examples(smol, 3, 8, seed=3) == examples  # seeded


def test_qa_calibration_prompts_come_from_the_range_with_the_gold_at_the_depths(smol):
    path = data_file("derived_nq_20docs_bm25pool_gold_at_0.jsonl.gz")
    examples = qa_calibration_examples(smol, path, "100:200", examples=4, num_docs=10)
    with gzip.open(path, "rt") as f:
        records = [json.loads(line) for line in f][100:104]
    for e, rec, depth in zip(examples, records, [2, 5, 7, 2], strict=True):
        assert (e.task, e.depth) == ("qa", depth)
        text = smol.detokenize(e.prompt_ids)
        assert text.endswith(f"Question: {rec['question']}\nAnswer:\nassistant\n")
        gold_line = next(
            line for line in text.splitlines() if line.startswith(f"Document [{depth + 1}]")
        )
        assert rec["ctxs"][0]["text"] in gold_line
        assert smol.detokenize(e.answer_ids) == " " + rec["answers"][0]
    with pytest.raises(ConfigError, match=r"records 195:200 hold 5 valid QA samples, 6 wanted"):
        qa_calibration_examples(smol, path, "195:200", examples=6, num_docs=10)
    kv = data_file("litm_kv_retrieval_75_keys.jsonl.gz")
    with pytest.raises(ConfigError, match="QA calibration needs a QA file"):
        qa_calibration_examples(smol, kv, "0:10", examples=2, num_docs=10)


def test_scores_split_and_selection():
    def prompt(task, depth):
        return CalibrationPrompt(task, depth, [1], [2])

    examples = [prompt("kv", 1), prompt("kv", 2), prompt("kv", 1), prompt("qa", 5), prompt("qa", 2)]
    s = score_setting(np.array([1.0, 4.0, 3.0, 0.5, 1.5]), examples, 7, 0.0)
    assert s.by_depth == {"kv@1": 2.0, "kv@2": 4.0, "qa@2": 1.5, "qa@5": 0.5}
    assert s.loss == pytest.approx(2.0)
    assert s.gap == pytest.approx((2.0 + 1.0) / 2)  # per task max - min, averaged
    tune, held = _split([prompt("kv", d) for d in (1, 2, 3, 1)] + [prompt("qa", 4)] * 3)
    assert [(e.task, e.depth) for e in tune] == [("kv", 1), ("kv", 3), ("qa", 4), ("qa", 4)]
    assert [(e.task, e.depth) for e in held] == [("kv", 2), ("kv", 1), ("qa", 4)]

    def score(channel, factor, loss, gap):
        return SettingScore(channel=channel, factor=factor, loss=loss, gap=gap)

    best_tuned = score(8, 0.0, 1.0, 1.0)
    heldout = [score(None, 1.0, 1.0, 0.5), score(8, 0.0, 0.9, 0.7), score(3, -1.0, 1.2, 0.2)]
    assert select(heldout, best_tuned, "loss") == heldout[1]
    assert select(heldout, best_tuned, "gap") == heldout[2]
    unmodified = select(heldout[:2], best_tuned, "gap")  # nothing beats the unmodified model
    assert (unmodified.channel, unmodified.factor, unmodified.gap) == (8, 1.0, 0.5)


def test_random_text_ids(smol):
    ids = random_text_ids(smol, samples=2, length=50, seed=0)
    assert ids.shape == (2, 50)
    assert not torch.equal(ids[0], ids[1])
    assert torch.equal(ids, random_text_ids(smol, 2, 50, seed=0))


def _tiny_backend(smol, arch="llama"):
    m = tiny_model(arch, seed=0, num_hidden_layers=8, vocab_size=len(smol.tokenizer))
    m.ragfix_name = f"tiny-{arch}"
    return HFBackend(m, smol.tokenizer)


def test_calibrate_end_to_end_and_artefact(smol, tmp_path):
    backend = _tiny_backend(smol)
    settings = CalibrationSettings.for_backend(
        backend,
        samples=3,
        length=64,
        kv_examples=4,
        kv_pairs=4,
        qa_data=str(data_file("derived_nq_20docs_bm25pool_gold_at_0.jsonl.gz")),
        qa_records="100:200",
        qa_docs=3,
        layers=[3, 4],
        top_k=3,
        finalists=2,
        stability_seed=1,
    )
    assert settings.qa_examples == 4  # as many as the KV half
    cal = calibrate(backend, settings, progress=False)
    assert cal.prompts == {"tune": 4, "heldout": 4}
    best = min(cal.candidates, key=lambda c: c.loss)
    assert cal.factor_losses["0.0"] == best.loss
    assert cal.tune[0].channel is None and cal.tune[0].loss == cal.baseline_loss
    assert [s.loss for s in cal.tune[1:]] == sorted(s.loss for s in cal.tune[1:])
    # the held-out stage scores the unmodified model and the 2 best tuned settings
    assert [(s.channel, s.factor) for s in cal.heldout] == [(None, 1.0)] + [
        (s.channel, s.factor) for s in cal.tune[1:3]
    ]
    winner = min(cal.heldout, key=lambda s: s.loss)
    assert cal.beats_unmodified == (winner.channel is not None)
    assert (cal.channel, cal.factor) == (
        (winner.channel, winner.factor) if cal.beats_unmodified else (cal.tune[1].channel, 1.0)
    )
    # the unmodified tune loss is the mean of the full teacher-forced losses of the tune half
    tune, _ = _split(calibration_prompts(backend, settings))
    base = np.mean(
        [
            example_losses(backend.model, e.prompt_ids, e.answer_ids, [3, 4], [(0, 1.0)])[0]
            for e in tune
        ]
    )
    assert cal.baseline_loss == pytest.approx(base, rel=1e-6)
    assert cal.stability.seeds == [0, 1] and len(cal.stability.other_candidates) <= 3
    assert cal.stability.shared == len(
        {c.channel for c in cal.candidates} & set(cal.stability.other_candidates)
    )
    assert cal.settings["kv_pairs"] == 4
    spec = calibration_table(cal)
    chosen = (cal.channel, cal.factor) if cal.beats_unmodified else (None, 1.0)
    assert [r[0] for r in spec.rows] == [
        ("unmodified" if t.channel is None else f"channel {t.channel} x {t.factor:g}")
        + (" (chosen)" if (t.channel, t.factor) == chosen else "")
        for t in cal.tune
    ]
    assert sum("(chosen)" in r[0] for r in spec.rows) == 1
    held = {(h.channel, h.factor): h for h in cal.heldout}
    assert [r[3] for r in spec.rows if r[3]] == [
        f"{held[t.channel, t.factor].loss:.4f}" for t in cal.tune if (t.channel, t.factor) in held
    ]
    assert "records 100:200 of `derived_nq_20docs_bm25pool_gold_at_0.jsonl.gz`" in spec.lines[0]
    assert spec.lines[1].startswith("Stability: the random texts of seeds 0 and 1 share")
    path = tmp_path / "calib" / "tiny.json"
    cal.save(path)
    back = ChannelScalingCalibration.load(path, backend.model)
    assert back == cal
    scaled = ChannelScalingBackend(backend.model, smol.tokenizer, calibration=str(path))
    try:
        assert scaled.identity()["scaling"] == {
            "channel": cal.channel,
            "layers": [3, 4],
            "factor": cal.factor,
            "source": f"calibration:{path}",
            "calibration": content_fingerprint(path),
        }
    finally:
        scaled.scaling.remove()
    unchanged = tmp_path / "unchanged.json"
    cal.model_copy(update={"beats_unmodified": False, "factor": 1.0}).save(unchanged)
    with pytest.warns(UserWarning, match="no scaled setting beat the unmodified model"):
        scaled = ChannelScalingBackend(backend.model, smol.tokenizer, calibration=str(unchanged))
    assert scaled.scaling.state.factor == 1.0
    scaled.scaling.remove()
    other = _tiny_backend(smol, "qwen2")
    with pytest.raises(ConfigError, match="for model 'tiny-llama'.*not for 'tiny-qwen2'"):
        ChannelScalingCalibration.load(path, other.model)
    with pytest.raises(ConfigError, match="calibrated for model"):
        ChannelScalingBackend(other.model, smol.tokenizer, calibration=str(path))


def test_bad_calibration_files(tmp_path):
    with pytest.raises(ConfigError, match="calibration file not found"):
        ChannelScalingCalibration.load(tmp_path / "none.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(DataError, match=r"bad\.json:1: not JSON"):
        ChannelScalingCalibration.load(bad)
    bad.write_text(json.dumps({"model": {}, "channel": 3}))
    with pytest.raises(DataError, match=r"bad\.json: layers: Field required"):
        ChannelScalingCalibration.load(bad)


def test_cli_rejects_bad_grid_before_loading():
    from ragfix.cli.app import app

    res = CliRunner().invoke(
        app, ["calibrate", "--out", "x.json", "--model", "/no/model", "--factors", "a,b"]
    )
    assert res.exit_code == 2
    assert "--factors 'a,b': expected numbers" in res.output
    res = CliRunner().invoke(app, ["calibrate", "--out", "x.json", "--layers", "5-x"])
    assert res.exit_code == 2
    assert "layers '5-x'" in res.output


def test_user_errors_one_line_only_for_ragfix_errors(capsys):
    import typer

    from ragfix.cli.common import user_errors

    with pytest.raises(typer.Exit) as exit_info, user_errors():
        raise DataError("d.jsonl", 3, "answers", "empty")
    assert exit_info.value.exit_code == 2
    assert capsys.readouterr().err.strip() == "error: d.jsonl:3: answers: empty"
    with pytest.raises(typer.Exit), user_errors():
        CalibrationSettings(samples=0, length=64, kv_examples=1, kv_pairs=2, layers=[1])
    assert capsys.readouterr().err.startswith("error: samples: Input should be greater")
    # a bug is not a user's mistake: it keeps its type and traceback
    for bug in (ValueError("zip() argument 2 is shorter"), FileNotFoundError("x"), KeyError("k")):
        with pytest.raises(type(bug)), user_errors():
            raise bug
    assert capsys.readouterr().err == ""


def test_layers_out_of_range_is_a_config_error(smol):
    backend = _tiny_backend(smol)
    settings = CalibrationSettings.for_backend(backend, samples=1, length=64, layers=[3, 8])
    with pytest.raises(ConfigError, match=r"layers \[3, 8\]: out of range 0..7"):
        calibrate(backend, settings, progress=False)
