"""Worker settings from BATCHERY_* variables, URL masking, queue naming and the fault parser."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from batchery.contract.settings import DEFAULT_BROKER_URL, Settings, mask_url, queue_for_model
from batchery.engine.config import EngineConfig
from batchery.worker.service.faults import PARSERS, RebuildRaise, StepHang, StepRaise, parse_faults


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    import os

    for k in list(os.environ):
        if k.startswith("BATCHERY_"):
            monkeypatch.delenv(k)


def test_defaults():
    s = Settings()
    assert s.broker_url == DEFAULT_BROKER_URL
    assert s.result_backend == s.broker_url
    assert s.model == "smollm2-135m-instruct"
    assert s.queue == "batchery.smollm2-135m-instruct"
    assert s.visibility_timeout > s.max_task_timeout >= s.task_timeout
    assert s.num_task_threads >= s.max_num_seqs
    assert s.faults == ""


def test_env_names_and_nested_engine_options(monkeypatch):
    env = {
        "BATCHERY_BROKER_URL": "redis://:secret@redis:6379/2",
        "BATCHERY_MODEL": "/models/My Model.gguf",
        "BATCHERY_DTYPE": "float32",
        "BATCHERY_MAX_NUM_SEQS": "32",
        "BATCHERY_TASK_TIMEOUT": "30",
        "BATCHERY_MAX_RETRIES": "5",
        "BATCHERY_VISIBILITY_TIMEOUT": "9000",
        "BATCHERY_HEALTH_PORT": "9100",
        "BATCHERY_FAULTS": "step_raise:3",
        "BATCHERY_ENGINE__NUM_KV_BLOCKS": "100",
        "BATCHERY_ENGINE__BLOCK_SIZE": "32",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    s = Settings()
    assert s.result_backend == "redis://:secret@redis:6379/2"
    assert s.queue == "batchery.my-model"
    assert (s.max_num_seqs, s.task_timeout, s.max_retries, s.visibility_timeout, s.health_port) == (
        32,
        30,
        5,
        9000,
        9100,
    )
    cfg = EngineConfig(**s.engine_kwargs())
    assert (cfg.model, cfg.dtype, cfg.max_num_seqs, cfg.num_kv_blocks, cfg.block_size) == (
        "/models/My Model.gguf",
        "float32",
        32,
        100,
        32,
    )
    assert "secret" not in str(s.describe())


def test_explicit_queue_wins(monkeypatch):
    monkeypatch.setenv("BATCHERY_QUEUE", "gpu-a")
    assert Settings().queue == "gpu-a"


def test_visibility_timeout_must_outlast_the_longest_deadline(monkeypatch):
    monkeypatch.setenv("BATCHERY_MAX_TASK_TIMEOUT", "600")
    monkeypatch.setenv("BATCHERY_VISIBILITY_TIMEOUT", "600")
    with pytest.raises(ValidationError, match="VISIBILITY_TIMEOUT"):
        Settings()


@pytest.mark.parametrize(
    "env",
    [
        {"BATCHERY_TASK_TIMEOUT": "100", "BATCHERY_MAX_TASK_TIMEOUT": "50"},
        {"BATCHERY_DTYPE": "int8"},
        {"BATCHERY_MAX_NUM_SEQS": "0"},
        {"BATCHERY_HEALTH_PORT": "70000"},
    ],
)
def test_invalid_settings_fail_clearly(monkeypatch, env):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ValidationError):
        Settings()


@pytest.mark.parametrize(
    "url, masked",
    [
        ("redis://:secret@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://user:secret@host/0", "redis://user:***@host/0"),
        ("rediss://u:p%40ss@[::1]:6380/1", "rediss://u:***@[::1]:6380/1"),
        ("redis://host:6379/0", "redis://host:6379/0"),
        ("sentinel://:pw@a:26379;sentinel://:pw@b:26379", None),
        # each sentinel address is masked, also when the first has no port (it leaked the second's)
        ("sentinel://:pw@a;sentinel://:pw@b:26379", "sentinel://:***@a;sentinel://:***@b:26379"),
        (
            "sentinel://:pw@a:1/0;sentinel://:pw@b:2/0?master_name=m",
            "sentinel://:***@a:1/0;sentinel://:***@b:2/0?master_name=m",
        ),
    ],
)
def test_mask_url_never_shows_a_password(url, masked):
    out = mask_url(url)
    if masked is not None:
        assert out == masked
    assert "secret" not in out and "p%40ss" not in out and ":pw@" not in out


def test_queue_for_model():
    assert queue_for_model("smollm2-135m-instruct") == "batchery.smollm2-135m-instruct"
    assert queue_for_model("/tmp/x/Tiny_Llama/") == "batchery.tiny_llama"
    assert queue_for_model("models/qwen.Q4_K.gguf") == "batchery.qwen.q4_k"


def test_fault_parser():
    faults = parse_faults(" step_raise:3, step_hang:5:2.5 ,rebuild_raise:2")
    assert [type(f) for f in faults] == [StepRaise, StepHang, RebuildRaise]
    assert (faults[0].at_step, faults[1].at_step, faults[1].seconds, faults[2].count) == (3, 5, 2.5, 2)
    assert parse_faults("") == [] and parse_faults(None) == []
    assert set(PARSERS) >= {"step_raise", "step_hang"}


@pytest.mark.parametrize(
    "spec, needle",
    [
        ("step_raise", "expected step_raise:N"),
        ("step_raise:0", ">= 1"),
        ("step_raise:x", "integer"),
        ("step_hang:3", "expected step_hang:N:SECONDS"),
        ("step_hang:3:-1", ">= 0"),
        ("explode:1", "unknown fault 'explode'"),
    ],
)
def test_fault_parser_errors_name_the_entry(spec, needle):
    with pytest.raises(ValueError, match=needle):
        parse_faults(spec)


def test_step_raise_fires_once_on_its_step():
    import threading

    from batchery.worker.service.faults import InjectedFault, StepContext

    f = parse_faults("step_raise:2")[0]
    ctx = lambda n: StepContext(step=n, seqs=[], engine=None, abandoned=threading.Event())  # noqa: E731
    f.before_step(ctx(1))
    with pytest.raises(InjectedFault, match="step 2"):
        f.before_step(ctx(2))
    f.before_step(ctx(2))  # once


def test_exit_on_parses_free_text():
    from batchery.worker.service.faults import ExitOn

    (f,) = parse_faults("exit_on: stop: now")
    assert isinstance(f, ExitOn) and f.text == " stop: now"
    with pytest.raises(ValueError, match="expected exit_on:TEXT"):
        parse_faults("exit_on: ")
