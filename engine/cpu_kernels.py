"""The CPU kernels, in C++, built once on first use with torch's cpp_extension and cached.

- ``paged_decode``: decode attention read straight from the paged KV pool, and ``store_kv``: the step's
  K/V written into it (both used by ``batchery.engine.attention.cpu_paged``);
- ``argmax_rows``: torch.argmax over the rows of a float or bf16 matrix, vectorized (the sampler's greedy rows);
- ``linear_t``: an fp32 linear over a pre-transposed weight, and ``linear_bf16`` (with
  ``pack_bf16``): a bf16 linear for CPUs with AVX512-BF16 (both used by ``batchery.engine.fast_linear``).

The C++ lives in ``engine/csrc/`` (package data: a wheel carries it and builds it on first use), one file per
kind of kernel; ``SOURCES`` are this module's files there, and other modules add their own as parts (``PARTS``:
modules naming their ``SOURCES`` and the ``FUNCTIONS`` they export), compiled into the same extension with
``bindings.cpp`` (which exports every function by name) so one build and one load serve all. The build is
cached by a hash of every file in ``csrc/`` (headers included), the flags and torch.

If the build fails (no compiler, no ninja) every caller falls back to torch; set
``BATCHERY_CPU_KERNELS=0`` to skip the build and use torch everywhere.

Builds are serialized by a lock of our own (``flock`` on ``build.lock`` beside the notes), which the kernel
releases when its holder dies. cpp_extension's own lock is a plain file (``lock`` in its build directory) that a
process killed mid-build (a worker stopped during start-up, a test's timeout) leaves behind, and every later
build then waits for it forever, silently. Holding our lock, no other Batchery process is building, so such a
file is stale: it is removed, with a warning, before the build."""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import logging
import os
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("batchery.engine.kernels")

NAME = "batchery_cpu_kernels_v38"  # the module's name (and torch's build directory); the note is keyed by the sources

CSRC = Path(__file__).resolve().with_name("csrc")  # the C++ sources and headers

# This module's kernels (in csrc/): decode attention over the paged pool, the K/V store, the greedy argmax, the fp32 and
# bf16 linears (their tiles in linear_tiles.h), the AMX linears
SOURCES: tuple[str, ...] = ("decode_attention.cpp", "store_kv.cpp", "argmax.cpp", "linear.cpp", "amx_linear.cpp")
_BINDINGS = "bindings.cpp"  # the Python module: every function of every part, by name

_FUNCTIONS = [
    "paged_decode",
    "store_kv",
    "argmax_rows",
    "linear_t",
    "pack_panels",
    "linear_panels",
    "pack_bf16",
    "linear_bf16",
    "linear_bf16_into",
    "has_bf16_linear",
    "pack_bf16_gate_up",
    "linear_bf16_silu",
    "has_bf16_silu",
    "pack_amx",
    "linear_amx",
    "has_amx_linear",
    "pack_amx_gate_up",
    "linear_amx_silu",
]

# Modules whose C++ ``SOURCES`` (in csrc/, exporting ``FUNCTIONS``) are compiled into this extension, in order.
PARTS: tuple[str, ...] = ("batchery.engine.cpu_fused", "batchery.engine.attention.cpu_prefill")


def _parts() -> list[types.ModuleType]:
    return [importlib.import_module(name) for name in PARTS]


def sources() -> list[Path]:
    """The .cpp files compiled, in order: this module's, each part's, then the bindings."""
    names = [*SOURCES, *(name for part in _parts() for name in part.SOURCES), _BINDINGS]
    return [CSRC / name for name in names]


def headers() -> list[Path]:
    """The headers the sources include (csrc/*.h), by name."""
    return sorted(CSRC.glob("*.h"))


def full_source() -> str:
    """Everything compiled: the headers, then the sources in order, each file under its name."""
    return "\n".join(f"// ==== {path.name}\n{path.read_text()}" for path in [*headers(), *sources()])


def functions() -> list[str]:
    """The names the built module exports."""
    return [*_FUNCTIONS, *(name for part in _parts() for name in part.FUNCTIONS)]


_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]  # without it at::parallel_for runs on one thread

_lock = threading.Lock()
_module: types.ModuleType | None = None
_failed = False


def _built_marker() -> Path:
    """Where the path of the extension built from exactly this source, these flags and this torch is noted.

    Loading the built ``.so`` through cpp_extension's ``load`` imports ``torch.utils.cpp_extension`` (setuptools)
    and runs ninja to find it up to date, a few hundred ms of every worker's start; with the note the ``.so`` is
    imported directly. Keyed by everything the build depends on, and the note holds the file's size and mtime,
    so a rebuild in place (another source under the same name) is never taken for this one."""
    import torch

    key = json.dumps(
        [
            NAME,
            full_source(),
            functions(),
            _CFLAGS,
            _LDFLAGS,
            torch.__version__,
            sys.version,
            sys.platform,
            os.environ.get("TORCH_EXTENSIONS_DIR", ""),
        ]
    )
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "batchery" / "kernels"
    return base / f"{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def _load_built(marker: Path) -> types.ModuleType | None:
    try:
        note = json.loads(marker.read_text())
        so = Path(note["so"])
        st = so.stat()
        if [st.st_size, st.st_mtime_ns] != note["stat"] or note["name"] != so.name.split(".")[0]:
            return None
        spec = importlib.util.spec_from_file_location(note["name"], so)
        if spec is None or spec.loader is None:
            return None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        if not all(hasattr(module, f) for f in functions()):
            return None
        return module
    except Exception:  # noqa: BLE001 - no note, a stale one, an unloadable file: build as before
        return None


def _note_built(marker: Path, module: types.ModuleType) -> None:
    try:
        so = Path(str(module.__file__))
        st = so.stat()
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"so": str(so), "name": module.__name__, "stat": [st.st_size, st.st_mtime_ns]}))
        os.replace(tmp, marker)
    except (OSError, TypeError, ValueError) as e:  # a read-only home: load through cpp_extension next time too
        log.debug("could not note the built CPU kernels: %s", e)


@contextlib.contextmanager
def _build_lock(marker: Path) -> Iterator[None]:
    """Hold the build lock (waiting, with a log line, while another process builds). Without a writable cache
    directory the build goes on unlocked, as cpp_extension alone would do it."""
    import fcntl

    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        f = open(marker.parent / "build.lock", "a+")  # noqa: SIM115 - held for the whole build
    except OSError as e:
        log.debug("no build lock (%s); building unlocked", e)
        yield
        return
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("another process is building the CPU kernels; waiting for it")
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def clear_stale_baton(build_dir: Path) -> bool:
    """Remove cpp_extension's lock file from ``build_dir`` (called with the build lock held, so no live Batchery
    process is building there: the file was left by one that died mid-build). Returns whether one was there."""
    baton = build_dir / "lock"
    try:
        baton.unlink()
    except FileNotFoundError:
        return False
    except OSError as e:
        log.warning("could not remove %s (%s); the build may wait for it", baton, e)
        return False
    log.warning("removed %s, left by a process that died while building the CPU kernels", baton)
    return True


def _torch_build_dir() -> Path | None:
    try:
        from torch.utils.cpp_extension import _get_build_directory

        return Path(_get_build_directory(NAME, verbose=False))
    except Exception as e:  # noqa: BLE001 - a private helper of torch's: without it, nothing to clear
        log.debug("cpp_extension's build directory unknown (%s)", e)
        return None


def load() -> types.ModuleType | None:
    """The compiled module, or None when it cannot be built here (callers then use torch)."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is None and not _failed:
            if os.environ.get("BATCHERY_CPU_KERNELS", "1") == "0":
                _failed = True
                return None
            try:
                marker = _built_marker()
            except OSError as e:  # csrc/ missing or unreadable (a broken install): the torch paths still work
                _failed = True
                log.warning("CPU kernels unavailable (their sources: %s); using torch", e)
                return None
            _module = _load_built(marker)
            if _module is not None:
                return _module
            with _build_lock(marker):
                _module = _load_built(marker)  # built by the process this one waited for
                if _module is None:
                    _build(marker)
    return _module


def _build(marker: Path) -> None:
    global _module, _failed
    try:
        from torch.utils.cpp_extension import load as load_extension

        build_dir = _torch_build_dir()
        if build_dir is not None:
            clear_stale_baton(build_dir)
        log.info("building the CPU kernels (first use only, cached afterwards)")
        _module = load_extension(
            name=NAME,
            sources=[str(path) for path in sources()],
            extra_cflags=list(_CFLAGS),  # cpp_extension appends to the lists it is given
            extra_ldflags=list(_LDFLAGS),
            verbose=False,
        )
        _note_built(marker, _module)
    except Exception as e:  # no compiler, no ninja, ...: the torch paths still work
        _failed = True
        log.warning("CPU kernels unavailable (%s); using torch", str(e).splitlines()[0] if str(e) else type(e).__name__)
