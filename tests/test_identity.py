"""What a run ran on: content fingerprints of files and folders, the ``weights`` field of a model's
identity (weight files or tensors), adapters (weights and LoRA settings), calibration files and
served models (the same server at another address is the same model). Real tiny models, real
files, a real HTTP stand-in for an OpenAI-compatible server."""

from __future__ import annotations

import json
import os
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
import torch
from conftest import ROOT, tiny_model
from fake_openai import LocalServer

import ragfix.io
import ragfix.models.load
from ragfix.backends.channel_scaling import ChannelScalingBackend, ChannelScalingCalibration
from ragfix.errors import AdapterError, ConfigError
from ragfix.fingerprint import FINGERPRINT_INDEX, content_fingerprint
from ragfix.lora import METADATA_FILE, load_adapter
from ragfix.models.gguf import gguf_fingerprint
from ragfix.models.load import (
    checkpoint_files_fingerprint,
    load_model,
    load_tokenizer,
    model_identity,
)
from ragfix.models.resolve import ModelSpec

#: a modification time well in the past (files the tests write are "old" checkpoints)
OLD_NS = 1_600_000_000 * 10**9


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty ragfix cache of the test's own (the fingerprint index lives there)."""
    d = tmp_path / "cache"
    monkeypatch.setenv("RAGFIX_CACHE", str(d))
    return d


@pytest.fixture
def hashed(monkeypatch) -> list[Path]:
    """The files whose bytes are read by the fingerprint helper during the test."""
    seen: list[Path] = []
    real = ragfix.io.file_fingerprint

    def counting(path):
        seen.append(Path(path))
        return real(path)

    monkeypatch.setattr(ragfix.io, "file_fingerprint", counting)
    return seen


@pytest.fixture(scope="module")
def tokenizer():
    """SmolLM2's tokenizer (with its chat template), without the weights."""
    return load_tokenizer("smollm2")


def _age(folder: Path) -> None:
    """Give every file of ``folder`` an old modification time (a checkpoint saved earlier)."""
    for f in folder.iterdir():
        os.utime(f, ns=(OLD_NS, OLD_NS))


def _save(folder: Path, model, tokenizer) -> None:
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


# ------------------------------------------------------------------ files and folders


def test_content_fingerprint_of_files_and_folders(tmp_path, cache, hashed):
    d = tmp_path / "corpus"
    (d / "sub").mkdir(parents=True)
    (d / "a.txt").write_text("alpha")
    (d / "sub" / "b.txt").write_text("beta")
    (d / ".hidden").write_text("not read")
    _age(d)
    _age(d / "sub")
    first = content_fingerprint(d)
    assert len(first) == 16 and set(first) <= set("0123456789abcdef")
    assert content_fingerprint(d / "a.txt") == ragfix.io.file_fingerprint(d / "a.txt")
    hashed.clear()
    assert content_fingerprint(d) == first and hashed == []  # remembered in the index
    index = json.loads((cache / FINGERPRINT_INDEX).read_text())
    assert str((d / "sub" / "b.txt").resolve()) in index
    (d / ".hidden").write_text("still not read")
    assert content_fingerprint(d) == first
    (d / "sub" / "b.txt").rename(d / "sub" / "c.txt")  # same bytes, other name
    renamed = content_fingerprint(d)
    assert renamed != first
    (d / "a.txt").write_text("alphb")  # same size, rewritten now
    assert content_fingerprint(d) not in (first, renamed)
    # a GGUF file's fingerprint is the same helper
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF" + bytes(10))
    assert gguf_fingerprint(g) == content_fingerprint(g) == ragfix.io.file_fingerprint(g)


def test_a_file_rewritten_at_once_is_hashed_again(tmp_path, cache):
    # a rewrite within the timestamp granularity keeps size and mtime: recent files are not
    # remembered
    f = tmp_path / "x.json"
    f.write_text('{"a": 1}')
    before = content_fingerprint(f)
    st = f.stat()
    f.write_text('{"a": 2}')
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # same size, same mtime
    assert content_fingerprint(f) != before


# ------------------------------------------------------------------ weights of a model


def _untouched_weight(model) -> torch.nn.Parameter:
    """A weight matrix the sign-bit ``fingerprint`` does not sample (not the embedding, not the
    first or last other matrix)."""
    return model.model.layers[1].mlp.down_proj.weight


def test_weights_tell_apart_what_the_old_fingerprint_misses():
    a, b = tiny_model(seed=1), tiny_model(seed=1)
    with torch.no_grad():
        _untouched_weight(b)[3, 5] += 1.0
    ia, ib = model_identity(a), model_identity(b)
    assert ia["fingerprint"] == ib["fingerprint"]  # the old fingerprint's blind spot
    assert ia["weights"] != ib["weights"]
    assert ia["weights"].startswith("tensors:") and len(ia["weights"]) == len("tensors:") + 16


def test_in_memory_weights_follow_in_place_changes_and_are_remembered(monkeypatch):
    m = tiny_model(seed=2)
    first = model_identity(m)["weights"]
    calls = []
    real = ragfix.models.load.tensors_fingerprint
    monkeypatch.setattr(
        ragfix.models.load, "tensors_fingerprint", lambda model: calls.append(1) or real(model)
    )
    assert model_identity(m)["weights"] == first and calls == []  # remembered
    w = _untouched_weight(m)
    old = w[0, 0].item()
    with torch.no_grad():
        w[0, 0] = old + 0.5  # a training step or a merge, in place
    changed = model_identity(m)["weights"]
    assert changed != first and calls == [1]
    assert model_identity(m)["weights"] == changed and calls == [1]
    with torch.no_grad():
        w[0, 0] = old  # the same bytes again: the hash is of the content
    assert model_identity(m)["weights"] == first
    # a cast keeps the sign-bit fingerprint but not the tensors' bytes
    half = tiny_model(seed=2).to(torch.bfloat16)
    assert model_identity(half)["fingerprint"] == model_identity(m)["fingerprint"]
    assert model_identity(half)["weights"] != first


def test_files_weights_follow_the_checkpoint_folder(tmp_path, cache, hashed, tokenizer):
    d = tmp_path / "ckpt"
    _save(d, tiny_model(seed=3, attn="sdpa"), tokenizer)
    _age(d)
    m1, _ = load_model(str(d), device="cpu")
    w1 = model_identity(m1)["weights"]
    assert w1.startswith("files:") and len(w1) == len("files:") + 16
    # the weight files and what says how they are read (ragfix.fingerprint.is_weight_file) only
    names = ["config.json", "generation_config.json", "model.safetensors"]
    assert sorted(hashed) == [(d / n).resolve() for n in names]
    index = json.loads((cache / FINGERPRINT_INDEX).read_text())
    assert str((d / "model.safetensors").resolve()) in index
    # unchanged folder: the same value, read from the index
    hashed.clear()
    m2, _ = load_model(str(d), device="cpu")
    assert model_identity(m2)["weights"] == w1 and hashed == []
    # files that are not weights do not count
    (d / "README.md").write_text("notes")
    (d / "training_args.bin").write_bytes(b"args")
    assert model_identity(load_model(str(d), device="cpu")[0])["weights"] == w1
    # other weights saved into the same folder: another value
    tiny_model(seed=4, attn="sdpa").save_pretrained(d)
    m3, _ = load_model(str(d), device="cpu")
    w3 = model_identity(m3)["weights"]
    assert w3.startswith("files:") and w3 != w1
    # the model loaded before keeps the value of the weights it holds
    assert model_identity(m1)["weights"] == w1
    # a model loaded from files and then changed is identified by its tensors
    with torch.no_grad():
        _untouched_weight(m3).mul_(2)
    assert model_identity(m3)["weights"].startswith("tensors:")


def test_hub_weights_are_those_of_the_local_snapshot(tmp_path, cache, monkeypatch):
    from huggingface_hub import constants

    hub = tmp_path / "hub"
    repo = hub / "models--someone--tiny"
    snap = repo / "snapshots" / ("0" * 40)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    tiny_model(seed=5).save_pretrained(snap)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    spec = ModelSpec("someone/tiny", "hub", "someone/tiny")
    local = ModelSpec(str(snap), "local", str(snap))
    assert checkpoint_files_fingerprint(spec) == checkpoint_files_fingerprint(local) is not None
    missing = ModelSpec("someone/absent", "hub", "someone/absent")
    assert checkpoint_files_fingerprint(missing) is None


# ------------------------------------------------------------------ adapters


@pytest.fixture
def lora(tmp_path, tokenizer):
    """A tiny base checkpoint folder and a peft LoRA folder for it (non-zero B)."""
    from peft import LoraConfig, get_peft_model

    base = tmp_path / "base"
    _save(base, tiny_model(seed=6, attn="sdpa"), tokenizer)
    torch.manual_seed(0)
    cfg = LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    d = tmp_path / "lora"
    get_peft_model(load_model(str(base), device="cpu")[0], cfg).save_pretrained(d)
    return base, d


def test_adapter_fingerprint_covers_its_lora_settings(lora, cache):
    base, d = lora
    plain = load_model(str(base), device="cpu")[0]
    m1, info1 = load_adapter(load_model(str(base), device="cpu")[0], d)
    ids = torch.tensor([[5, 6, 7, 8]])
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg["lora_alpha"] = 16  # same weights, twice the update
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    m2, info2 = load_adapter(load_model(str(base), device="cpu")[0], d)
    assert info1["fingerprint"] != info2["fingerprint"] and len(info2["fingerprint"]) == 16
    with torch.no_grad():
        assert not torch.allclose(m1(input_ids=ids).logits, m2(input_ids=ids).logits)
    # the adapted model's weights are the base files' and the adapter's, not the base files'
    w0, w1, w2 = (model_identity(m)["weights"] for m in (plain, m1, m2))
    assert all(w.startswith("files:") for w in (w0, w1, w2)) and len({w0, w1, w2}) == 3


def test_adapter_of_other_weight_files_is_refused(lora, cache, tmp_path):
    base, d = lora
    model = load_model(str(base), device="cpu")[0]
    meta_dir = tmp_path / "meta"
    meta_dir.mkdir()
    for f in d.iterdir():
        (meta_dir / f.name).write_bytes(f.read_bytes())

    def with_base(weights):
        ident = {**model_identity(model), "weights": weights}
        meta = {"format": "ragfix-pos2distill", "kind": "lora", "base_model": ident}
        (meta_dir / METADATA_FILE).write_text(json.dumps(meta))

    with_base("files:0123456789abcdef")
    with pytest.raises(AdapterError, match="differing: weights$"):
        load_adapter(model, meta_dir)
    # a tensor hash (dtype dependent) or no weights at all (older artefacts) is not compared
    for weights in ("tensors:0123456789abcdef", None):
        with_base(weights)
        load_adapter(load_model(str(base), device="cpu")[0], meta_dir)


# ------------------------------------------------------------------ calibration files


def _calibration(model, path: Path) -> None:
    ChannelScalingCalibration(
        model=model_identity(model),
        channel=5,
        layers=[1],
        factor=-1.0,
        baseline_loss=1.0,
        factor_losses={"-1.0": 0.9},
        candidates=[],
        settings={"note": "aaaa"},
        minutes=0.5,
    ).save(path)


def _scaled_identity(model, tokenizer, path: Path) -> dict:
    b = ChannelScalingBackend(model, tokenizer, calibration=str(path))
    try:
        return b.identity()
    finally:
        b.scaling.remove()


def test_calibration_file_edited_in_place_changes_the_identity(tmp_path, cache, tokenizer):
    model = tiny_model(seed=7, attn="sdpa")
    path = tmp_path / "cal.json"
    _calibration(model, path)
    first = _scaled_identity(model, tokenizer, path)
    assert first["scaling"]["calibration"] == content_fingerprint(path)
    assert _scaled_identity(model, tokenizer, path) == first
    raw = path.read_text()
    path.write_text(raw.replace('"aaaa"', '"bbbb"'))  # same settings, same size, other file
    second = _scaled_identity(model, tokenizer, path)
    assert {k: v for k, v in second["scaling"].items() if k != "calibration"} == {
        k: v for k, v in first["scaling"].items() if k != "calibration"
    }
    assert second["scaling"]["calibration"] != first["scaling"]["calibration"]
    # without a calibration file there is none to record
    b = ChannelScalingBackend(model, tokenizer, channel=5, layers=[1], factor=-1.0)
    assert "calibration" not in b.identity()["scaling"]
    b.scaling.remove()


def test_calibration_for_other_weight_files_is_refused(tmp_path, cache, tokenizer):
    d = tmp_path / "ckpt"
    _save(d, tiny_model(seed=8, attn="sdpa"), tokenizer)
    model = load_model(str(d), device="cpu")[0]
    path = tmp_path / "cal.json"
    _calibration(model, path)
    assert ChannelScalingCalibration.load(path, model).model["weights"].startswith("files:")
    doc = json.loads(path.read_text())
    doc["model"]["weights"] = "files:0123456789abcdef"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"weights files:0123456789abcdef.*ragfix calibrate"):
        ChannelScalingCalibration.load(path, model)
    for weights in ("tensors:0123456789abcdef", None):
        doc["model"]["weights"] = weights
        path.write_text(json.dumps(doc))
        ChannelScalingCalibration.load(path, model)


# ------------------------------------------------------------------ what ships


def test_shipped_adapters_and_calibrations_still_fit_their_models():
    """Every shipped calibration fits SmolLM2; every shipped adapter loads onto the base model
    its metadata names (SmolLM2 or Gemma 3 270M) and changes its weights."""
    model = load_model("smollm2", device="cpu")[0]
    ident = model_identity(model)
    assert ident["weights"] == f"files:{gguf_fingerprint(ragfix.models.smollm2_gguf_path())}"
    for cal in sorted((ROOT / "calib").glob("*.json")):
        ChannelScalingCalibration.load(cal, model)
    bases = set()
    for d in sorted((ROOT / "adapters").iterdir()):
        base = json.loads((d / "ragfix_adapter.json").read_text())["base_model"]["name"]
        bases.add(base)
        plain = model_identity(load_model(base, device="cpu")[0])["weights"]
        adapted, info = load_adapter(load_model(base, device="cpu")[0], d)
        assert len(info["fingerprint"]) == 16
        assert model_identity(adapted)["weights"] not in (plain, None)
    assert bases == {"smollm2", "gemma3-270m"}


# ------------------------------------------------------------------ served models


class FakeServer:
    """A stand-in OpenAI-compatible server on 127.0.0.1 that lists one model, as ``ragfix
    serve`` does (its ``created`` is the start time, so it differs between starts)."""

    def __init__(self, created: int, weights: str = "files:00000000000000aa"):
        entry = {
            "id": "tiny",
            "object": "model",
            "created": created,
            "owned_by": "ragfix",
            "max_model_len": 256,
            "ragfix": {"model": {"name": "tiny", "weights": weights}, "backend": "vanilla"},
        }
        body = json.dumps({"object": "list", "data": [entry]}).encode()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self.send_response(200 if self.path.endswith("/models") else 404)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = LocalServer(Handler)
        self.url = self.httpd.url

    def close(self):
        self.httpd.close()


def test_remote_identity_ignores_the_address_and_the_start_time():
    from ragfix.backends.remote import RemoteBackend

    servers = [FakeServer(1_700_000_000), FakeServer(1_700_000_999), FakeServer(1, "files:bb")]
    try:
        a, b, other = (RemoteBackend("tiny", api_base=s.url, max_retries=0) for s in servers)
        assert a.endpoint != b.endpoint
        assert a.identity() == b.identity()
        assert servers[0].url not in json.dumps(a.identity())
        assert "created" not in a.identity()["model"]["server"]
        assert a.identity()["model"]["server"]["ragfix"]["model"]["weights"]
        assert other.identity() != a.identity()  # other weights behind the same id
    finally:
        for s in servers:
            s.close()
