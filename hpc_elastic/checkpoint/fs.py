"""Durable file primitives: fsync'd writes, directory fsync, atomic replace, hashing writers."""

from __future__ import annotations

import hashlib
import os
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Replace ``path`` by ``data`` atomically: a temporary file beside it, fsync, rename, fsync the directory.
    A reader sees the old content or the new one, never a mix, whenever the writer dies."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


class HashingWriter:
    """A write-only file object that forwards to ``fh`` and keeps the sha256 and size of what passed through.

    A large write is cut into pieces that are hashed on a helper thread while the calling thread writes them:
    both ``hashlib`` and the ``write`` system call release the GIL, so hashing costs almost no extra time.  Every
    piece is hashed before :meth:`write` returns (the caller may reuse its buffer afterwards), in order.

    ``on_first_write`` (fault injection for tests) runs once, after the first chunk has reached the file.
    Use it as a context manager (or call :meth:`close`) so that the helper thread ends."""

    PIECE = 16 << 20  # bytes written / hashed per piece
    PIPELINE_MIN = 2 * PIECE  # smaller writes are hashed inline

    def __init__(self, fh: BinaryIO, on_first_write: Callable[[], None] | None = None) -> None:
        self._fh = fh
        self._sha = hashlib.sha256()
        self.size = 0
        self._hook = on_first_write
        self._pool: ThreadPoolExecutor | None = None

    def write(self, data: bytes | bytearray | memoryview) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes >= self.PIPELINE_MIN:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpc-elastic-sha256")
            pending = []
            for offset in range(0, view.nbytes, self.PIECE):
                piece = view[offset : offset + self.PIECE]
                pending.append(self._pool.submit(self._sha.update, piece))  # one worker: in order
                self._fh.write(piece)
            for future in pending:
                future.result()
        else:
            self._fh.write(view)
            self._sha.update(view)
        self.size += view.nbytes
        if self._hook is not None:
            self._fh.flush()
            hook, self._hook = self._hook, None
            hook()
        return view.nbytes

    def flush(self) -> None:
        self._fh.flush()

    def hexdigest(self) -> str:
        return self._sha.hexdigest()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sha256_file(path: Path, chunk: int = 8 << 20) -> tuple[str, int]:
    """sha256 and size of the file at ``path``."""
    sha = hashlib.sha256()
    size = 0
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            sha.update(block)
            size += len(block)
    return sha.hexdigest(), size
