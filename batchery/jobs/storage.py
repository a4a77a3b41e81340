"""Where the bytes of files live: a ``FileStorage``. Two users:

- the HTTP API's uploaded and result files (``batchery.api.files``): their metadata (owner, name, purpose, size,
  the per-tenant listing) lives in Redis; a storage only keeps objects by key, so every API replica that sees the
  same Redis and the same storage serves the same files;
- big batch jobs' inputs (``batchery.jobs.submit``): a job that outgrows its window is fed from a copy of its input
  in the store (``BATCHERY_STORAGE_URL``, ``open_storage``), which any worker can take over feeding from.

``LocalStorage(root)`` keeps each object as one file under ``root`` (``BATCHERY_API__STORAGE_DIR``: a
volume in compose, shared by the replicas). An object is written to a temporary name in the same
directory, flushed and fsynced, then renamed onto its key (``os.replace``, atomic on POSIX), and the
directory is fsynced: a crash, a refused upload (too large, not JSONL) or a client that hangs up mid-upload
never leaves a half file under a real key. Leftover temporaries (``.<key>.<random>.part``, from a process
killed mid-write) are swept when a storage opens, once they are a day old.

**Adding an object store (S3, GCS, Azure Blob).** One more class with the same four operations, chosen
by the settings where ``files_of`` builds ``LocalStorage`` today; nothing else changes (the Redis
metadata stays as it is):

- ``writer(key, limit)`` -> an ``ObjectWriter`` over a multipart upload: ``write`` buffers to the part
  size (5 MiB at S3) and uploads each part, raising ``ObjectTooLarge`` past ``limit``; ``commit`` completes
  the upload (an object appears whole or not at all, as with the rename here); ``abort`` aborts it (and a
  bucket lifecycle rule removes the parts of uploads a crash left incomplete, as the sweep does here);
- ``open(key)`` -> a binary reader over a streamed ``GetObject`` body (``FileNotFoundError`` for a missing
  key); ``delete(key)`` -> ``DeleteObject``; ``size(key)`` -> ``HeadObject``'s ``ContentLength``;
- ``local_path(key)`` -> ``None``: callers that prefer a path (the batch submitter) then read through
  ``open``."""

from __future__ import annotations

import os
import re
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import BinaryIO, Protocol

KEY_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
WRITE_BUFFER = 1 << 20  # bytes a writer buffers before the OS sees them
PARTIAL_SUFFIX = ".part"
PARTIAL_MAX_AGE_S = 86400.0  # a temporary this old belongs to a process that died mid-write


class StorageError(Exception):
    """The configured store cannot be used (an unsupported URL, a directory that cannot be created or written)."""


class ObjectTooLarge(Exception):
    """A write went past its size limit. Nothing is left under the key."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the object is larger than {limit} bytes")
        self.limit = limit


class ObjectWriter(Protocol):
    """One object being written. Nothing is visible under its key until ``commit``; ``abort`` (or leaving
    the ``with`` block without ``commit``) discards it."""

    @property
    def written(self) -> int: ...

    def write(self, data: bytes) -> None:
        """Append ``data``; ``ObjectTooLarge`` (and nothing written) when it would pass the limit."""
        ...

    def commit(self) -> int:
        """Make the object durable and visible under its key; returns its size."""
        ...

    def abort(self) -> None:
        """Discard what was written. Safe to call twice, or after ``commit`` (then it does nothing)."""
        ...

    def __enter__(self) -> ObjectWriter: ...

    def __exit__(self, *exc: object) -> None: ...


class FileStorage(Protocol):
    """Objects by key: write once (streamed, with a size limit), read, delete."""

    def writer(self, key: str, limit: int | None = None) -> ObjectWriter:
        """A new object under ``key`` (a fresh key: ids are never reused), at most ``limit`` bytes."""
        ...

    def write_stream(self, key: str, chunks: Iterable[bytes], limit: int | None = None) -> int:
        """Write ``chunks`` as the object ``key`` and commit it; returns its size. On any error (including
        ``ObjectTooLarge`` and one raised by ``chunks``) nothing is left under ``key``."""
        ...

    def open(self, key: str) -> BinaryIO:
        """A binary reader of the object; ``FileNotFoundError`` when there is none."""
        ...

    def delete(self, key: str) -> bool:
        """Remove the object; False when there was none."""
        ...

    def size(self, key: str) -> int:
        """The object's size in bytes; ``FileNotFoundError`` when there is none."""
        ...

    def local_path(self, key: str) -> Path | None:
        """The object's path on this machine, for readers that want one; None for remote stores."""
        ...


def check_key(key: str) -> str:
    """Keys are plain names (letters, digits, ``.``, ``_``, ``-``; no leading dot): never a path."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise ValueError(f"invalid storage key {key!r}")
    return key


def write_all(writer: ObjectWriter, chunks: Iterable[bytes]) -> int:
    """Feed ``chunks`` to ``writer`` and commit; abort on any error."""
    with writer:
        for chunk in chunks:
            writer.write(chunk)
        return writer.commit()


class LocalWriter:
    """An object being written under ``LocalStorage``: a temporary file beside its final name."""

    def __init__(self, root: Path, key: str, limit: int | None) -> None:
        self._final = root / key
        self._root = root
        self._limit = limit
        fd, tmp = tempfile.mkstemp(dir=root, prefix=f".{key}.", suffix=PARTIAL_SUFFIX)
        self._tmp = Path(tmp)
        self._f: BinaryIO | None = os.fdopen(fd, "wb", buffering=WRITE_BUFFER)
        self._written = 0
        self._done = False

    @property
    def written(self) -> int:
        return self._written

    def write(self, data: bytes) -> None:
        if self._f is None:
            raise ValueError("the object was already committed or aborted")
        if self._limit is not None and self._written + len(data) > self._limit:
            raise ObjectTooLarge(self._limit)
        self._f.write(data)
        self._written += len(data)

    def commit(self) -> int:
        if self._f is None:
            raise ValueError("the object was already committed or aborted")
        f, self._f = self._f, None
        try:
            f.flush()
            os.fsync(f.fileno())
            f.close()
            os.replace(self._tmp, self._final)
        except BaseException:
            f.close()
            self._unlink_tmp()
            raise
        self._done = True
        fsync_dir(self._root)
        return self._written

    def abort(self) -> None:
        if self._done:
            return
        self._done = True
        if self._f is not None:
            f, self._f = self._f, None
            f.close()
        self._unlink_tmp()

    def _unlink_tmp(self) -> None:
        try:
            self._tmp.unlink()
        except FileNotFoundError:
            pass

    def __enter__(self) -> LocalWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.abort()  # after a commit this does nothing


def fsync_dir(path: Path) -> None:
    """Make a rename or unlink in ``path`` durable (a no-op where directories cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class LocalStorage:
    """Objects as files in one directory (``BATCHERY_API__STORAGE_DIR``), readable by every replica that
    mounts it."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(os.path.expanduser(os.fspath(root))).resolve()
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.sweep_partials()

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def writer(self, key: str, limit: int | None = None) -> LocalWriter:
        return LocalWriter(self.root, check_key(key), limit)

    def write_stream(self, key: str, chunks: Iterable[bytes], limit: int | None = None) -> int:
        return write_all(self.writer(key, limit), chunks)

    def open(self, key: str) -> BinaryIO:
        return self._path(key).open("rb")

    def delete(self, key: str) -> bool:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            return False
        fsync_dir(self.root)
        return True

    def size(self, key: str) -> int:
        return self._path(key).stat().st_size

    def local_path(self, key: str) -> Path | None:
        return self._path(key)

    def list_keys(self, glob: str = "*") -> list[str]:
        """The keys of the objects whose names match ``glob`` (temporaries excluded)."""
        return sorted(p.name for p in self.root.glob(glob) if not p.name.startswith(".") and p.is_file())

    def sweep_partials(self, older_than_s: float = PARTIAL_MAX_AGE_S) -> int:
        """Remove temporaries left by processes that died mid-write; returns how many. Young ones may
        belong to a replica still writing them, so they stay."""
        cutoff = time.time() - older_than_s
        removed = 0
        for p in self.root.glob(f".*{PARTIAL_SUFFIX}"):
            try:
                if p.stat().st_mtime < cutoff:
                    p.unlink()
                    removed += 1
            except OSError:
                continue
        return removed


def open_storage(url: str) -> LocalStorage:
    """The store ``url`` names (``BATCHERY_STORAGE_URL``): a directory path or a ``file://`` URL, created if need be
    and checked writable. ``StorageError`` names the problem (another scheme: an object store is one more class
    here; a directory that cannot be created or written)."""
    path = url
    if "://" in url:
        scheme, _, rest = url.partition("://")
        if scheme != "file":
            raise StorageError(
                f"BATCHERY_STORAGE_URL {url!r}: scheme {scheme!r} is not supported (a directory path or file:// URL)"
            )
        path = rest
    if not path:
        raise StorageError("BATCHERY_STORAGE_URL is empty: set it to a directory that submitters and workers share")
    try:
        storage = LocalStorage(path)
        probe = storage.writer(f"probe-{os.getpid()}")
        probe.abort()
    except OSError as exc:
        raise StorageError(
            f"BATCHERY_STORAGE_URL {url!r} is not a writable directory ({type(exc).__name__}: {exc})"
        ) from exc
    return storage
