"""File primitives of the whole package: durable atomic writes (temporary file, fsync, rename, fsync of the
directory), hashing writers, and reads of files that someone else may have planted (no symbolic link followed, no
FIFO or device opened, the owner checked, the size bounded).

Every atomic write of the package goes through :func:`atomic_write_bytes` (checkpoints, the control files of a job
directory, profiles, the daemon's state file); :func:`sweep_temporaries` removes what a writer killed in one left
behind. Every read of a file a user controls, by a process that runs with more rights than that user, goes through
:func:`read_owned`; every input file a user names to a command (a config, trace, cluster file, model, profile)
through :func:`open_input`, :func:`read_input` or :func:`read_text_input`, and every JSON document from outside the
process through :func:`loads_json`.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any, BinaryIO

from hpc_elastic.errors import HpcElasticError


class UnsafeFile(HpcElasticError):
    """A file or directory is not what it must be: a symbolic link, not a regular file or directory, owned by
    another user, writable by others, or larger than allowed."""


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (creations, renames, removals) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


#: the name of a temporary of :func:`atomic_write_bytes`: ``.<name>.tmp-<pid>-<16 hex digits>``
TEMPORARY = re.compile(r"\..+\.tmp-[0-9]+-[0-9a-f]{16}")
#: a temporary last modified this long ago belongs to a writer that died (a write takes milliseconds)
STALE_TEMPORARY_S = 600.0


def atomic_write_bytes(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Replace ``path`` by ``data`` atomically: a temporary file beside it, fsync, rename, fsync the directory.
    A reader sees the old content or the new one, never a mix, whenever the writer dies.

    The temporary file has an unpredictable name and is created exclusively without following a link
    (``O_EXCL | O_NOFOLLOW``), so nothing planted in the directory can redirect the write; ``rename`` replaces a
    link at ``path`` itself rather than writing through it."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(8)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fchmod(fh.fileno(), mode)  # whatever the umask
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def sweep_temporaries(directory: Path, *, now: float, older_than_s: float = STALE_TEMPORARY_S) -> int:
    """Remove what writers killed inside :func:`atomic_write_bytes` (between the temporary's creation and its
    rename: SIGKILL, a node lost) left in ``directory``: this user's plain files named as its temporaries and last
    modified more than ``older_than_s`` before ``now``. The file each was to replace is intact. A write in
    progress is younger, a link or another user's file is left alone; the number removed."""
    try:
        entries = os.scandir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return 0
    removed = 0
    with entries:
        for entry in entries:
            if not TEMPORARY.fullmatch(entry.name):
                continue
            try:
                info = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(info.st_mode) and info.st_uid == os.getuid() and now - info.st_mtime > older_than_s:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed += 1
    return removed


#: the most one read of :func:`read_owned` asks for
READ_CHUNK = 1 << 20


def read_owned(base: Path, parts: Sequence[str], *, limit: int, owner: int | None = None) -> bytes:
    """The content of the regular file ``base/parts[0]/.../parts[-1]``, read safely where others may have planted
    links, FIFOs or huge files: ``base`` is trusted (a site path); below it no component is followed if it is a
    symbolic link, every directory and the file must belong to ``owner`` (a uid; None: any owner), the file is opened
    without blocking (a FIFO or a device is refused, not waited on) and may hold at most ``limit`` bytes.

    Raises :class:`FileNotFoundError` when a component is missing, :class:`UnsafeFile` for everything above, and
    :class:`OSError` when the file cannot be read."""
    if not parts or any(not p or p in {".", ".."} or "/" in p or "\x00" in p for p in parts):
        raise ValueError(f"not a relative path of plain components: {list(parts)!r}")
    fds: list[int] = []
    try:
        fds.append(os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC))
        for part in parts[:-1]:
            fds.append(_open_below(fds[-1], part, os.O_RDONLY | os.O_DIRECTORY, base))
            _check_owner(os.fstat(fds[-1]), owner, base, part)
        fd = _open_below(fds[-1], parts[-1], os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY, base)
        fds.append(fd)
        info = os.fstat(fd)
        where = os.path.join(base, *parts)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(f"{where} is not a regular file")
        _check_owner(info, owner, base, where)
        if info.st_size > limit:
            raise UnsafeFile(f"{where} holds {info.st_size} bytes, more than the {limit} allowed")
        chunks: list[bytes] = []
        size = 0
        # read to the end (a read may return less than asked: a network filesystem, a large file), one byte past
        # the limit at most: a file grown since fstat is refused too
        while chunk := os.read(fd, min(READ_CHUNK, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise UnsafeFile(f"{where} holds more than the {limit} bytes allowed")
        return b"".join(chunks)
    finally:
        for fd in reversed(fds):
            os.close(fd)


#: the most bytes :func:`read_input` reads from one input file unless the caller says otherwise
MAX_INPUT_BYTES = 1 << 30


def open_input(path: Path, *, encoding: str | None = None, newline: str | None = None) -> IO[Any]:
    """An input file a user named to a command, open for reading (binary, or text in ``encoding``): opened without
    blocking and refused unless it is a regular file, so a FIFO, a device (``/dev/zero``) or a directory is one
    error, not a read that waits or never ends. Raises :class:`OSError` (``FileNotFoundError`` when it is missing;
    ``strerror`` says what is wrong)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a FIFO, a device or a directory)", str(path))
        os.set_blocking(fd, True)
        if encoding is None:
            return os.fdopen(fd, "rb")
        return os.fdopen(fd, "r", encoding=encoding, newline=newline)
    except BaseException:
        os.close(fd)
        raise


def read_input(path: Path, *, limit: int = MAX_INPUT_BYTES) -> bytes:
    """The content of the input file ``path`` (see :func:`open_input`), at most ``limit`` bytes: a larger file is an
    :class:`OSError` (``EFBIG``) before anything is read into memory."""
    with open_input(path) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise OSError(errno.EFBIG, f"{size} bytes, more than the {limit} allowed", str(path))
        data: bytes = fh.read(limit + 1)  # one byte past the limit at most: a file grown since fstat
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"more than the {limit} bytes allowed", str(path))
    return data


def read_text_input(path: Path, what: str) -> str:
    """The UTF-8 text of the input file ``path`` (:func:`read_input`); one ``ValueError`` ``cannot read <what>
    '<path>': <reason>`` when it is missing, not a regular file, too large or not UTF-8."""
    try:
        return read_input(path).decode("utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise ValueError(f"cannot read {what} {str(path)!r}: {exc}") from None


def loads_json(text: str | bytes, what: str) -> Any:
    """``json.loads(text)``, with every way a document from outside can fail as one :class:`ValueError` naming
    ``what``: not JSON, not UTF-8, or nested deeper than the decoder goes (which raises ``RecursionError``)."""
    try:
        return json.loads(text)
    except ValueError as exc:  # (JSONDecodeError and UnicodeDecodeError are ValueErrors)
        raise ValueError(f"{what} is not JSON: {exc}") from None
    except RecursionError:
        raise ValueError(f"{what} is not JSON: nested too deeply") from None


def _open_below(dir_fd: int, name: str, flags: int, base: Path) -> int:
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
            raise UnsafeFile(f"{name} under {base} is a symbolic link or not a directory") from None
        raise


def _check_owner(info: os.stat_result, owner: int | None, base: Path, what: str) -> None:
    if owner is not None and info.st_uid != owner:
        raise UnsafeFile(f"{what} under {base} belongs to uid {info.st_uid}, not {owner}")


def _probe_write(directory: Path) -> None:
    """Create and remove an empty file in ``directory``: whether this process may write there, asked of the
    filesystem itself (a permission, a read-only mount, a pseudo-filesystem such as ``/proc``); ``OSError``."""
    probe = directory / f".probe-{os.getpid()}-{secrets.token_hex(8)}"
    os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
    os.unlink(probe)


def check_output_file(path: Path, what: str) -> Path:
    """``path`` checked as a file a command writes when its work is done, before the work: in a directory that
    exists and takes new files, not a directory itself; ``ValueError`` naming ``what`` (an option) otherwise."""
    if not path.parent.is_dir():
        raise ValueError(f"{what} {str(path)!r}: directory {str(path.parent)!r} does not exist")
    if path.is_dir():
        raise ValueError(f"{what} {str(path)!r} is a directory")
    try:
        _probe_write(path.parent)
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r}: cannot write in {str(path.parent)!r}: {exc.strerror or exc}") from None
    return path


def check_output_dir(path: Path, what: str) -> Path:
    """``path`` checked as a directory a command creates if need be and writes into when its work is done, before
    the work: its nearest existing ancestor is a directory that takes new files; ``ValueError`` naming ``what``."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"{what} {str(path)!r}: {str(existing)!r} is not a directory")
    try:
        _probe_write(existing)
    except OSError as exc:
        raise ValueError(f"{what} {str(path)!r}: cannot write in {str(existing)!r}: {exc.strerror or exc}") from None
    return path


@contextlib.contextmanager
def dirs_kept_on_success(path: Path) -> Iterator[Path]:
    """Create directory ``path`` and its missing parents for the ``with`` block; if the block raises, remove the
    ones this call created (deepest first, each only while still empty), so that a refusal leaves nothing made."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    except BaseException:
        for made in missing:  # deepest first
            try:
                made.rmdir()
            except OSError:  # not empty (someone wrote into it) or already gone: keep what is not ours alone
                break
        raise


def private_dir(path: Path, mode: int) -> Path:
    """Create directory ``path`` (its parent must exist) with ``mode``, or check the existing one: a real directory
    (not a link) of this process's user that no other user may write into; then set its mode to ``mode``.  Raise
    :class:`UnsafeFile` otherwise: a directory someone else made or can write into may hold planted files."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, mode)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeFile(f"{path} is a symbolic link or not a directory") from None
        raise
    try:
        info = os.fstat(fd)
        if info.st_uid != os.getuid():
            raise UnsafeFile(f"{path} belongs to uid {info.st_uid}, not to this user ({os.getuid()})")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafeFile(f"{path} is writable by other users (mode {stat.S_IMODE(info.st_mode):o})")
        if stat.S_IMODE(info.st_mode) != mode:
            os.fchmod(fd, mode)
    finally:
        os.close(fd)
    return path


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


def wait_for_lock(
    lock: IO[Any], how: int, wait_s: float, *, on_wait: Callable[[], None] | None = None, poll_s: float = 2.0
) -> bool:
    """``flock(lock, how)`` (``fcntl.LOCK_SH`` or ``LOCK_EX``) on an open file, tried every ``poll_s`` seconds until
    ``wait_s`` have passed; whether it was taken. ``on_wait`` is called once, the first time another holds it."""
    deadline = time.monotonic() + wait_s
    waited = False
    while True:
        try:
            fcntl.flock(lock, how | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() > deadline:
                return False
            if on_wait is not None and not waited:
                on_wait()
            waited = True
            time.sleep(poll_s)
