"""Calibration for the channel-scaled backend: screening finds a planted positional channel, the
shared-prefix loss equals the full teacher-forced loss, the KV calibration prompts, the artefact,
and an end-to-end run on a tiny model with the real SmolLM2 tokenizer."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import tiny_model
from typer.testing import CliRunner

from ragfix.backends.channel_scaling import (
    ChannelScalingBackend,
    ChannelScalingCalibration,
    apply_channel_scaling,
)
from ragfix.backends.hf import HFBackend
from ragfix.calibrate import (
    CalibrationSettings,
    calibrate,
    example_losses,
    kv_calibration_examples,
    mean_hidden_states,
    random_text_ids,
    screen_channels,
)
from ragfix.errors import ConfigError, DataError


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
    for (prompt_ids, answer_ids), depth in zip(examples, [2, 4, 6], strict=True):
        text = smol.detokenize(prompt_ids)
        value = smol.detokenize(answer_ids)
        pair_lines = [line for line in text.splitlines() if '": "' in line]
        assert len(pair_lines) == 8
        assert value in pair_lines[depth]
        key = json.loads("{" + pair_lines[depth].strip(" ,{}") + "}")
        assert text.rstrip().endswith(f'The value of key "{next(iter(key))}" is "')
    assert kv_calibration_examples(smol, 3, 8, seed=3) == examples  # seeded


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
        kv_examples=3,
        kv_pairs=4,
        layers=[3, 4],
        top_k=3,
    )
    cal = calibrate(backend, settings, progress=False)
    assert cal.channel in [c.channel for c in cal.candidates]
    best = min(cal.candidates, key=lambda c: c.loss)
    assert cal.channel == best.channel
    assert cal.factor_losses["0.0"] == best.loss
    assert cal.factor_losses[str(cal.factor)] == min(cal.factor_losses.values())
    examples = kv_calibration_examples(backend, 3, 4, seed=0)
    base = np.mean(
        [example_losses(backend.model, p, a, [3, 4], [(0, 1.0)])[0] for p, a in examples]
    )
    assert cal.baseline_loss == pytest.approx(base, rel=1e-6)
    assert cal.settings["kv_pairs"] == 4
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
        }
    finally:
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
