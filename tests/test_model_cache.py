"""The converted-GGUF model cache (engine/loader.py): the first load of a GGUF keeps a Hugging Face
directory (fp32 safetensors, config, tokenizer) in the model cache, later loads read it, and what
they read is bitwise what the GGUF itself gives, in fp32 and in bf16, tokenizer included. A stale,
incomplete or corrupt conversion is never used.

Every test runs on a private model cache (``BATCHERY_MODEL_CACHE`` in a tmp dir) holding a copy of
the real default GGUF; nothing is downloaded when the user's cache already has it."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from batchery.contract.names import DEFAULT_MODEL
from batchery.engine import loader
from batchery.engine.config import EngineConfig

SAMPLES = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnewlines",
    "naïve café 東京 🙂",
    "<|im_start|>user\nhi<|im_end|>",
]
CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture(scope="module")
def real_gguf() -> Path:
    return loader.default_model_path()  # the user's cache (fetched once if it is not there yet)


@pytest.fixture
def cache(tmp_path, monkeypatch, real_gguf) -> Path:
    """A private model cache holding a copy of the default GGUF where ``default_model_path`` looks."""
    root = tmp_path / "models"
    dest = root / DEFAULT_MODEL / real_gguf.name
    dest.parent.mkdir(parents=True)
    try:
        os.link(real_gguf, dest)  # same file system: no copy (the tests never write to it)
    except OSError:
        shutil.copy2(real_gguf, dest)
    monkeypatch.setenv("BATCHERY_MODEL_CACHE", str(root))
    monkeypatch.delenv(loader.CONVERT_ENV, raising=False)
    return root


def _converted(cache: Path) -> list[Path]:
    """The converted directories (fp32), without their copies in other dtypes (``_variants``)."""
    hf = cache / "hf"
    if not hf.exists():
        return []
    return sorted(p for p in hf.iterdir() if p.is_dir() and not p.name.startswith(".") and not _is_variant(p))


def _is_variant(p: Path) -> bool:
    return p.name.endswith(("-bfloat16", "-float16"))


def _variants(cache: Path) -> list[Path]:
    hf = cache / "hf"
    return sorted(p for p in hf.iterdir() if p.is_dir() and _is_variant(p)) if hf.exists() else []


# -- keys: no model needed --------------------------------------------------------------------------


def test_sha256_is_remembered_and_recomputed_when_the_file_changes(tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHERY_MODEL_CACHE", str(tmp_path / "models"))
    f = tmp_path / "a.gguf"
    f.write_bytes(b"one" * 1000)
    first = loader.gguf_sha256(f)
    assert first == loader._sha256(f)
    index = tmp_path / "models" / "hf" / loader._SHA_INDEX
    assert str(f.resolve()) in index.read_text()
    # same size, new bytes, new mtime: hashed again, so the conversion key changes
    st = f.stat()
    f.write_bytes(b"two" * 1000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    second = loader.gguf_sha256(f)
    assert second == loader._sha256(f) != first
    dirs = {loader.converted_dir(f)}
    f.write_bytes(b"one" * 1000)
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000))
    dirs.add(loader.converted_dir(f))
    assert len(dirs) == 2, "a GGUF with other bytes must not reuse a conversion"
    # a corrupt index is ignored, not fatal
    index.write_text("{not json")
    assert loader.gguf_sha256(f) == first


def test_key_names_the_converting_code_versions(tmp_path, monkeypatch):
    import transformers

    monkeypatch.setenv("BATCHERY_MODEL_CACHE", str(tmp_path / "models"))
    f = tmp_path / "a.gguf"
    f.write_bytes(b"x")
    d = loader.converted_dir(f)
    assert d.parent == tmp_path / "models" / "hf"
    assert d.name.startswith(loader._sha256(f)[:32])
    assert f"tf{transformers.__version__}-" in d.name


def test_hf_model_dir_of_a_directory_is_itself_and_unknown_names_fail(tmp_path):
    assert loader.hf_model_dir(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="neither"):
        loader.hf_model_dir(str(tmp_path / "missing"))
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        loader.hf_model_dir(str(tmp_path / "weights.bin"))


# -- the real model ------------------------------------------------------------------------------


def _assert_same_model(a, b) -> None:
    pa, pb = dict(a.model.named_parameters()), dict(b.model.named_parameters())
    assert pa.keys() == pb.keys()
    for name in pa:
        x, y = pa[name], pb[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert torch.equal(
            x.view(torch.uint8) if x.is_contiguous() else x.contiguous().view(torch.uint8),
            y.view(torch.uint8) if y.is_contiguous() else y.contiguous().view(torch.uint8),
        ), name
    ba, bb = dict(a.model.named_buffers()), dict(b.model.named_buffers())
    assert ba.keys() == bb.keys()
    for name in ba:
        assert ba[name].dtype == bb[name].dtype and torch.equal(ba[name], bb[name]), name
    ea, eb = a.model.get_input_embeddings().weight, b.model.get_input_embeddings().weight
    la, lb = a.model.get_output_embeddings().weight, b.model.get_output_embeddings().weight
    assert (la.data_ptr() == ea.data_ptr()) == (lb.data_ptr() == eb.data_ptr()), "tied differently"
    ca, cb = a.hf_config.to_dict(), b.hf_config.to_dict()
    for k in ("_name_or_path", "transformers_version", "architectures"):  # save_pretrained names the class
        ca.pop(k, None)
        cb.pop(k, None)
    assert ca == cb


def _assert_same_tokenizer(a, b) -> None:
    for s in SAMPLES:
        assert a.encode(s) == b.encode(s), s
        assert a.decode(a.encode(s)) == b.decode(b.encode(s)), s
    for gen in (True, False):
        ra = a.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        assert ra == b.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=gen)
        assert a.encode(ra, add_special_tokens=False) == b.encode(ra, add_special_tokens=False)
    assert a.eos_token_id == b.eos_token_id and a.eos_token == b.eos_token
    assert a.bos_token_id == b.bos_token_id and a.pad_token_id == b.pad_token_id
    assert a.all_special_tokens == b.all_special_tokens and a.all_special_ids == b.all_special_ids
    assert len(a) == len(b) and a.get_vocab() == b.get_vocab()


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cached_conversion_loads_bitwise_what_the_gguf_gives(cache, monkeypatch, caplog, dtype):
    cfg = EngineConfig(dtype=dtype)
    monkeypatch.setenv(loader.CONVERT_ENV, "0")
    direct = loader.load_model(cfg)
    assert _converted(cache) == [], "BATCHERY_MODEL_CACHE_CONVERT=0 must not write a conversion"
    assert Path(direct.tokenizer.name_or_path) == cache / DEFAULT_MODEL

    monkeypatch.delenv(loader.CONVERT_ENV)
    first = loader.load_model(cfg)  # converts, then loads the conversion
    (conv,) = _converted(cache)
    assert Path(first.tokenizer.name_or_path) == conv
    assert {"config.json", "model.safetensors", "tokenizer.json", loader._MANIFEST} <= {p.name for p in conv.iterdir()}
    assert not [p for p in (cache / "hf").iterdir() if p.name.startswith(".tmp-")], "temp dir left behind"
    if dtype == "float32":
        assert _variants(cache) == [], "an fp32 load reads the conversion itself"
    else:  # the first load cast the fp32 weights and kept the cast copy beside the conversion
        (variant,) = _variants(cache)
        assert variant.name == f"{conv.name}-{dtype}"
        assert {"config.json", "model.safetensors", loader._MANIFEST} <= {p.name for p in variant.iterdir()}
        assert variant.stat().st_mode & 0o777 == 0o755
        assert (variant / "model.safetensors").stat().st_size < (conv / "model.safetensors").stat().st_size * 0.6
    t0 = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="batchery.engine.loader"):
        second = loader.load_model(cfg)
    took = time.perf_counter() - t0
    assert Path(second.tokenizer.name_or_path) == conv and _converted(cache) == [conv]
    (loaded_line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded model")]
    assert loaded_line.split(" from ")[1].split(" in ")[0] == str(conv if dtype == "float32" else variant)
    from batchery.engine import cpu_kernels

    kernels = cpu_kernels.load()
    from batchery.engine import fast_linear

    # bf16 layers are calibrated only where a bf16 route exists (our kernel: AVX512-BF16; oneDNN's packed matmul:
    # AVX-512 or AVX-NE-CONVERT); on AVX2 torch keeps them and nothing is timed
    bf16_route = kernels is not None and (bool(kernels.has_bf16_linear()) or fast_linear._onednn_ok(torch.bfloat16))
    calibrated = kernels is not None and (dtype == "float32" or bf16_route)
    assert loader.calibration_cache_path().exists() == calibrated, "load_model keeps the CPU calibration in the cache"
    for loaded in (first, second):
        _assert_same_model(direct, loaded)
        _assert_same_tokenizer(direct.tokenizer, loaded.tokenizer)
    logging.getLogger(__name__).info("load from the conversion: %.2f s", took)


@pytest.mark.slow
@pytest.mark.integration
def test_conversion_keeps_fp32_weights_and_ties_the_lm_head(cache):
    from transformers import AutoModelForCausalLM

    d = loader.hf_model_dir(DEFAULT_MODEL)
    assert d == loader.converted_dir(loader.default_model_path())
    assert loader.hf_model_dir(str(loader.default_model_path())) == d
    assert d.stat().st_mode & 0o777 == 0o755, "other users of a shared model cache must be able to read it"
    m = AutoModelForCausalLM.from_pretrained(str(d), local_files_only=True)
    assert m.config.tie_word_embeddings
    assert m.get_output_embeddings().weight.data_ptr() == m.get_input_embeddings().weight.data_ptr()
    assert {p.dtype for p in m.parameters()} == {torch.float32}


@pytest.mark.slow
@pytest.mark.integration
def test_incomplete_conversion_is_converted_again(cache, caplog):
    d = loader.hf_model_dir(DEFAULT_MODEL)
    weights = d / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:
        f.truncate(size // 2)
    with caplog.at_level(logging.WARNING, logger="batchery.engine.loader"):
        loaded = loader.load_model(EngineConfig(dtype="float32"))
    assert "incomplete" in caplog.text
    assert Path(loaded.tokenizer.name_or_path) == d and weights.stat().st_size == size
    # a directory without its manifest (a crash before the rename cannot leave one, but a user's copy can)
    (d / loader._MANIFEST).unlink()
    assert loader.hf_model_dir(DEFAULT_MODEL) == d and (d / loader._MANIFEST).exists()


@pytest.mark.slow
@pytest.mark.integration
def test_corrupt_conversion_falls_back_to_the_gguf(cache, caplog):
    d = loader.hf_model_dir(DEFAULT_MODEL)
    weights = d / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # same size, garbage header: only loading it can tell
        f.write(b"\xff" * 64)
    with caplog.at_level(logging.WARNING, logger="batchery.engine.loader"):
        loaded = loader.load_model(EngineConfig(dtype="float32"))
    assert "does not load" in caplog.text
    assert Path(loaded.tokenizer.name_or_path) == cache / DEFAULT_MODEL  # the GGUF served this load
    assert _converted(cache) == [], "the corrupt conversion was kept"
    assert loaded.tokenizer.encode("hi")
    again = loader.hf_model_dir(DEFAULT_MODEL)
    assert again == d and (d / "model.safetensors").stat().st_size == size


@pytest.mark.slow
@pytest.mark.integration
def test_a_broken_bf16_copy_is_never_used_and_is_written_again(cache, caplog):
    cfg = EngineConfig(dtype="bfloat16")
    reference = loader.load_model(cfg)  # converts, loads fp32 cast to bf16, keeps the bf16 copy
    (variant,) = _variants(cache)
    weights = variant / "model.safetensors"
    size = weights.stat().st_size
    with open(weights, "r+b") as f:  # incomplete: the manifest check tells
        f.truncate(size // 2)
    with caplog.at_level(logging.WARNING, logger="batchery.engine.loader"):
        again = loader.load_model(cfg)
    assert "incomplete" in caplog.text
    _assert_same_model(reference, again)
    assert weights.stat().st_size == size, "the copy was not written again"
    caplog.clear()
    with open(weights, "r+b") as f:  # same size, garbage header: only loading it can tell
        f.write(b"\xff" * 64)
    with caplog.at_level(logging.WARNING, logger="batchery.engine.loader"):
        third = loader.load_model(cfg)
    assert "does not load" in caplog.text
    _assert_same_model(reference, third)
    assert Path(third.tokenizer.name_or_path) == _converted(cache)[0], "the fp32 conversion served this load"
    with open(weights, "rb") as f:
        assert f.read(8) != b"\xff" * 8, "the copy was not written again"


@pytest.mark.slow
@pytest.mark.integration
def test_no_bf16_copy_without_the_conversion_cache(cache, monkeypatch):
    monkeypatch.setenv(loader.CONVERT_ENV, "0")
    loader.load_model(EngineConfig(dtype="bfloat16"))
    assert _converted(cache) == [] and _variants(cache) == []


# -- the CPU calibration cache (engine/fast_linear.py) -------------------------------------------------


def _linears(*shapes: tuple[int, int]) -> torch.nn.Module:
    return torch.nn.Sequential(*(torch.nn.Linear(i, o, bias=False) for i, o in shapes))


@pytest.fixture
def kernels(tmp_path, monkeypatch):
    from batchery.engine import cpu_kernels

    kernel = cpu_kernels.load()
    if kernel is None:
        pytest.fail("the CPU kernels did not build (compiler or ninja missing?)")
    monkeypatch.setenv("BATCHERY_MODEL_CACHE", str(tmp_path / "models"))
    monkeypatch.delenv("BATCHERY_CPU_CALIBRATION_CACHE", raising=False)
    from batchery.engine import fast_linear

    monkeypatch.setattr(fast_linear, "_machine_busy", lambda: None)  # the suite may run beside other work
    monkeypatch.setattr(fast_linear, "OTHERS_BUSY_SHARE", 2.0)  # no share of the CPUs counts as busy
    return kernel


def _limits(model: torch.nn.Module) -> list[int]:
    return [m._batchery_max_rows for m in model if hasattr(m, "_batchery_max_rows")]


def _only_host(path: Path) -> dict:
    import json

    (entry,) = json.loads(path.read_text())["hosts"].values()
    return entry


def test_calibration_is_kept_and_read_back(kernels):
    """A second install reads the limits: planted values calibration can never return show it."""
    import json

    from batchery.engine import fast_linear

    path = loader.calibration_cache_path()
    assert not path.exists()
    fast_linear.install(_linears((64, 128), (128, 64), (64, 128)), calibration_cache=path)
    entry = _only_host(path)
    # one calibration per shape: our kernel's limit, and oneDNN's (on a packed weight) beyond it
    assert set(entry["limits"]) == {
        "64x128:float32",
        "128x64:float32",
        "64x128:float32:onednn",
        "128x64:float32:onednn",
    }
    assert set(entry["limits"].values()) <= {0, fast_linear.ANY, *fast_linear.CALIBRATION_ROWS}
    assert entry["host"] == fast_linear.calibration_host()
    # plant limits calibration can never return: a second install must use them, not time anything
    planted = {"64x128:float32": 7, "128x64:float32": 5, "64x128:float32:onednn": 11, "128x64:float32:onednn": 9}
    entry["limits"] = dict(planted)
    data = json.loads(path.read_text())
    (key,) = data["hosts"]
    data["hosts"][key] = entry
    path.write_text(json.dumps(data))
    model = _linears((64, 128), (128, 64))
    assert fast_linear.install(model, calibration_cache=path) == 2
    assert _limits(model) == [7, 5]
    if fast_linear._onednn_ok(torch.float32):
        assert [m._batchery_onednn_rows for m in model] == [11, 9]
    # a shape it has not seen is calibrated and added beside them
    fast_linear.install(_linears((32, 48)), calibration_cache=path)
    limits = _only_host(path)["limits"]
    assert limits.pop("32x48:float32") in {0, fast_linear.ANY, *fast_linear.CALIBRATION_ROWS}
    assert limits.pop("32x48:float32:onednn") in {0, fast_linear.ANY, *fast_linear.CALIBRATION_ROWS}
    assert limits == planted


def test_calibration_cache_off_neither_reads_nor_writes(kernels, monkeypatch):
    import json

    from batchery.engine import fast_linear

    path = loader.calibration_cache_path()
    fast_linear.install(_linears((64, 128)), calibration_cache=path)
    data = json.loads(path.read_text())
    (key,) = data["hosts"]
    data["hosts"][key]["limits"] = {"64x128:float32": 7}
    path.write_text(json.dumps(data))
    before = path.read_bytes()
    monkeypatch.setenv("BATCHERY_CPU_CALIBRATION_CACHE", "0")
    model = _linears((64, 128), (32, 48))
    fast_linear.install(model, calibration_cache=path)
    assert 7 not in _limits(model)
    assert path.read_bytes() == before


def test_without_a_cache_path_install_writes_nothing(kernels, tmp_path):
    from batchery.engine import fast_linear

    fast_linear.install(_linears((64, 128)))
    assert not loader.calibration_cache_path().exists()


def test_a_changed_host_key_calibrates_again(kernels):
    import json

    from batchery.engine import fast_linear

    path = loader.calibration_cache_path()
    fast_linear.install(_linears((64, 128)), calibration_cache=path)
    data = json.loads(path.read_text())
    (key,) = data["hosts"]
    data["hosts"][key]["limits"] = {"64x128:float32": 7}
    path.write_text(json.dumps(data))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # another thread count: other timings, another key
        model = _linears((64, 128))
        fast_linear.install(model, calibration_cache=path)
        assert 7 not in _limits(model)
        hosts = json.loads(path.read_text())["hosts"]
        assert len(hosts) == 2 and hosts[key]["limits"] == {"64x128:float32": 7}, "the other host's entry is kept"
    finally:
        torch.set_num_threads(threads)
    model = _linears((64, 128))
    fast_linear.install(model, calibration_cache=path)
    assert _limits(model) == [7]  # back on the first key


def test_the_host_key_holds_cpu_torch_and_kernel_source(kernels):
    import hashlib

    from batchery.engine import cpu_kernels, fast_linear

    host = fast_linear.calibration_host()
    assert host["torch"] == torch.__version__ and host["torch_threads"] == torch.get_num_threads()
    assert (
        host["kernel_source_sha256"]
        == hashlib.sha256((cpu_kernels.NAME + "\0" + cpu_kernels.full_source()).encode()).hexdigest()
    )
    assert host["cores"] >= 1 and host["rows"] == list(fast_linear.CALIBRATION_ROWS)
    if Path("/proc/cpuinfo").exists():
        assert host["cpu"].get("model name") or host["cpu"].get("CPU part")


def test_an_unreadable_calibration_cache_is_replaced(kernels, caplog):
    from batchery.engine import fast_linear

    path = loader.calibration_cache_path()
    path.parent.mkdir(parents=True)
    path.write_text("{half a fi")
    with caplog.at_level(logging.WARNING, logger="batchery.engine.kernels"):
        fast_linear.install(_linears((64, 128)), calibration_cache=path)
    assert "unreadable" in caplog.text
    assert set(_only_host(path)["limits"]) == {"64x128:float32", "64x128:float32:onednn"}


@pytest.mark.slow
@pytest.mark.integration
def test_two_processes_convert_once(cache):
    import subprocess
    import sys

    code = "from batchery.engine.loader import hf_model_dir; print(hf_model_dir('smollm2-135m-instruct'))"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    dirs = {out.strip().splitlines()[-1] for out, _ in outs}
    assert len(dirs) == 1 and Path(dirs.pop()) == _converted(cache)[0]
    assert sum(err.count("Kept the converted") for _, err in outs) == 1, "converted twice"


@pytest.mark.slow
@pytest.mark.integration
def test_a_cache_it_cannot_write_never_fails_the_load(cache, caplog):
    (cache / "hf").write_text("a file where the converted models' directory should be")
    with caplog.at_level(logging.WARNING, logger="batchery.engine.loader"):
        loaded = loader.load_model(EngineConfig(dtype="float32"))
    assert "loading the GGUF" in caplog.text
    assert Path(loaded.tokenizer.name_or_path) == cache / DEFAULT_MODEL
    assert loaded.tokenizer.encode("hi")


def test_calibration_on_a_busy_machine_is_redone_on_a_quiet_one(kernels, monkeypatch, caplog):
    """Timings taken while the load average is above the cores are kept marked busy: busy starts read them, the
    first quiet start calibrates again and keeps clean results."""
    import json

    from batchery.engine import fast_linear

    monkeypatch.setattr(fast_linear, "_machine_busy", lambda: "load average 9.0 on 2 cores")
    path = loader.calibration_cache_path()
    with caplog.at_level("WARNING", logger="batchery.engine.kernels"):
        fast_linear.install(_linears((64, 128)), calibration_cache=path)
    assert "calibrated while load average 9.0 on 2 cores" in caplog.text
    entry = _only_host(path)
    assert entry["busy"] == "load average 9.0 on 2 cores"
    data = json.loads(path.read_text())
    (key,) = data["hosts"]
    data["hosts"][key]["limits"] = {"64x128:float32": 7}  # planted: calibration never returns 7
    path.write_text(json.dumps(data))
    model = _linears((64, 128))
    fast_linear.install(model, calibration_cache=path)
    assert _limits(model) == [7]  # still busy: the kept results are used
    monkeypatch.setattr(fast_linear, "_machine_busy", lambda: None)
    model = _linears((64, 128))
    fast_linear.install(model, calibration_cache=path)
    assert _limits(model) != [7]  # quiet: calibrated again
    entry = _only_host(path)
    assert "busy" not in entry and entry["limits"]["64x128:float32"] != 7


def _spin(n: int) -> list:
    """n processes that keep a CPU each busy until killed."""
    import subprocess
    import sys

    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def _stop(procs: list) -> None:
    for p in procs:
        p.kill()
        p.wait()


def test_others_share_counts_other_processes_and_not_this_one():
    """This process's own threads at work are not others'; processes spinning on every CPU are."""
    from batchery.engine import fast_linear

    start = fast_linear._cpu_sample()
    assert start is not None
    x = torch.randn(384, 384)
    t = time.monotonic()
    while time.monotonic() - t < 0.6:  # torch's threads busy in this process
        x = torch.tanh(x @ x)
    mine = fast_linear._others_share_since(start)
    procs = _spin(os.cpu_count() or 1)
    try:
        time.sleep(0.2)
        start = fast_linear._cpu_sample()
        time.sleep(0.6)
        others = fast_linear._others_share_since(start)
        busy = fast_linear._others_busy_since(start)
    finally:
        _stop(procs)
    assert mine is not None and mine < 0.5, mine
    assert others is not None and others > 0.6, others
    assert busy is not None and busy.startswith("other processes used")


def test_calibration_while_other_processes_ran_is_kept_marked_busy(kernels, monkeypatch):
    """The load average said quiet (patched by the fixture), but other processes took the CPUs while the layers
    calibrated: the results are kept marked busy, so the next quiet start calibrates again."""
    from batchery.engine import fast_linear

    monkeypatch.setattr(fast_linear, "OTHERS_BUSY_SHARE", 0.25)  # the real threshold (the fixture lifted it)
    path = loader.calibration_cache_path()
    procs = _spin(os.cpu_count() or 1)
    try:
        fast_linear.install(_linears((576, 1536), (1536, 576)), calibration_cache=path)
    finally:
        _stop(procs)
    assert _only_host(path)["busy"].startswith("other processes used")


def test_machine_busy_reads_the_load_average():
    from batchery.engine import fast_linear

    busy = fast_linear._machine_busy()
    assert busy is None or busy.startswith("load average ")
