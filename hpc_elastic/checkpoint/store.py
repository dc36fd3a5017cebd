"""Checkpoints of a job on the shared filesystem: per-rank shards, atomic commit, sha256 manifest, keep-K, async.

Saving step ``s`` (every rank calls :meth:`CheckpointStore.save` at the same step):

1. rank 0 draws a token and broadcasts it; every rank writes its shard into ``<root>/.tmp-ckpt-<s>-<token>/``
   (``torch.save`` through a sha256-counting writer, ``fsync``);
2. rank 0 collects every rank's file names, hashes and sizes (a collective gather when saving synchronously; small
   ``.part-<rank>.json`` files in the temporary directory when asynchronously), fsyncs the directory, writes
   ``MANIFEST.json`` (fsync), renames the directory to ``ckpt-<s>`` and fsyncs ``<root>``; then it deletes all but the
   newest ``keep`` checkpoints (and leftovers of interrupted saves);
3. rank 0 tells every rank the outcome.

A process killed at any instant leaves either no new checkpoint directory (the previous one stays the newest) or a
complete one.  Loading verifies the manifest, the size and the sha256 of every file it reads, and falls back to the
previous checkpoint when any of that fails; a file that is there but cannot be read now is an error
(:class:`UnreadableCheckpoint`), not an absence.  A commit never deletes a newer checkpoint: those of a timeline the
run abandoned are set aside as ``abandoned-ckpt-<s>-<token>``.

Asynchronous saves copy the shard's tensors to host memory before :meth:`save` returns; a background thread writes,
fsyncs and (rank 0) commits.  Background threads never run collectives.  :meth:`CheckpointStore.wait` — collective,
called by the next save and before exit — joins the thread and agrees on the outcome.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import json
import os
import secrets
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import IO, Any, TypeVar, cast

from hpc_elastic.checkpoint import layout
from hpc_elastic.checkpoint.layout import FileEntry, Manifest
from hpc_elastic.checkpoint.tree import check_loadable, to_host, torch_module
from hpc_elastic.collective import Collective, LocalCollective
from hpc_elastic.errors import HpcElasticError
from hpc_elastic.files import HashingWriter, atomic_write_bytes, fsync_dir, sha256_file

T = TypeVar("T")

DEFAULT_KEEP = 3
DEFAULT_COMMIT_TIMEOUT_S = 600.0
_POLL_S = 0.01


class CheckpointError(HpcElasticError):
    """A checkpoint could not be written or read."""


class CorruptCheckpoint(CheckpointError):
    """A checkpoint directory is incomplete, or a file does not match its manifest: loading falls back to the
    previous checkpoint."""


class UnreadableCheckpoint(CheckpointError):
    """A checkpoint file exists but cannot be read now (EIO, EACCES, a stale handle on the shared filesystem):
    an error on every rank, never taken for "no checkpoint" (training would restart from step 0)."""


def _read_failed(path: Path, exc: OSError) -> CheckpointError:
    """A missing file is a corrupt checkpoint; any other read error is an unreadable one."""
    if isinstance(exc, FileNotFoundError):
        return CorruptCheckpoint(f"checkpoint file {path} is missing")
    return UnreadableCheckpoint(f"checkpoint file {path} cannot be read: {exc.strerror or exc}")


class SaveMode(StrEnum):
    SYNC = "sync"
    ASYNC = "async"


def _part_name(rank: int) -> str:
    return f".part-{rank:05d}.json"


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint directory whose manifest parsed and whose files exist with the right sizes."""

    path: Path
    manifest: Manifest

    @property
    def step(self) -> int:
        return self.manifest.step

    @property
    def world_size(self) -> int:
        """The number of processes that saved it."""
        return self.manifest.world_size

    @property
    def meta(self) -> Mapping[str, Any]:
        return self.manifest.meta

    def has_shard(self, rank: int) -> bool:
        return layout.shard_name(rank) in self.manifest.files

    def read_verified(self, name: str) -> bytes:
        """The bytes of file ``name``, checked against the manifest's size and sha256."""
        entry = self.manifest.files.get(name)
        if entry is None:
            raise CorruptCheckpoint(f"checkpoint {self.path} has no {name}")
        try:
            data = (self.path / name).read_bytes()
        except OSError as exc:
            raise _read_failed(self.path / name, exc) from exc
        if len(data) != entry.size:
            raise CorruptCheckpoint(f"checkpoint file {self.path / name} has {len(data)} bytes, manifest {entry.size}")
        digest = hashlib.sha256(data).hexdigest()
        if digest != entry.sha256:
            raise CorruptCheckpoint(
                f"checkpoint file {self.path / name} is corrupt: sha256 {digest[:12]}… != manifest {entry.sha256[:12]}…"
            )
        return data

    def load_shard(self, rank: int, map_location: Any = "cpu") -> Any:
        """The object rank ``rank`` saved, loaded with ``torch.load(weights_only=True)`` after its hash checked."""
        torch = torch_module()
        data = self.read_verified(layout.shard_name(rank))
        try:
            return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        except Exception as exc:  # a verified file torch cannot read: another format, a torch too old
            raise CorruptCheckpoint(f"checkpoint shard {self.path / layout.shard_name(rank)}: {exc}") from exc

    def verify(self, names: Iterable[str] | None = None) -> None:
        """Check the sha256 of ``names`` (all files when omitted); raise :class:`CorruptCheckpoint`."""
        for name in sorted(self.manifest.files) if names is None else names:
            entry = self.manifest.files.get(name)
            if entry is None:
                raise CorruptCheckpoint(f"checkpoint {self.path} has no {name}")
            try:
                digest, size = sha256_file(self.path / name)
            except OSError as exc:
                raise _read_failed(self.path / name, exc) from exc
            if (digest, size) != (entry.sha256, entry.size):
                raise CorruptCheckpoint(f"checkpoint file {self.path / name} does not match its manifest")


def open_checkpoint(path: Path) -> Checkpoint:
    """The checkpoint in directory ``path``; :class:`CorruptCheckpoint` when its manifest is missing or invalid,
    or a file is missing or has the wrong size (hashes are checked when files are read)."""
    try:
        text = (path / layout.MANIFEST).read_text()
    except FileNotFoundError:
        raise CorruptCheckpoint(f"{path} is not a complete checkpoint (no {layout.MANIFEST})") from None
    except UnicodeDecodeError as exc:
        raise CorruptCheckpoint(f"checkpoint manifest in {path} is not text: {exc}") from exc
    except OSError as exc:
        raise _read_failed(path / layout.MANIFEST, exc) from exc
    try:
        manifest = layout.parse_manifest(text)
    except ValueError as exc:
        raise CorruptCheckpoint(f"checkpoint manifest in {path} is invalid: {exc}") from exc
    named = layout.step_of(path.name)
    if (named if named is not None else layout.replaced_step(path.name)) != manifest.step:
        raise CorruptCheckpoint(f"checkpoint {path} holds step {manifest.step}")
    for name, entry in manifest.files.items():
        try:
            size = (path / name).stat().st_size
        except OSError as exc:
            raise _read_failed(path / name, exc) from exc
        if size != entry.size:
            raise CorruptCheckpoint(f"checkpoint file {path / name} has {size} bytes, manifest {entry.size}")
    return Checkpoint(path, manifest)


class PendingSave:
    """A save in progress; :meth:`CheckpointStore.wait` completes it."""

    def __init__(self, step: int, path: Path, tmp: Path, thread: threading.Thread | None) -> None:
        self.step = step
        self.path = path  # where the checkpoint will be once committed
        self.tmp = tmp
        self.thread = thread
        self.error: str | None = None  # set by the thread (or the synchronous path)

    def done(self) -> bool:
        """Whether this process's part of the save has finished (no collective)."""
        return self.thread is None or not self.thread.is_alive()


def _without_zip_crc32() -> contextlib.AbstractContextManager[object]:
    """torch.save without the CRC32 of every zip record: the manifest's sha256 of the whole file, checked before
    any shard is loaded, already covers those bytes, and the CRC pass made a 1 GB save ~30 % slower than ``dd``
    of the same bytes (bench/ckpt.py).  torch.load reads such files as usual."""
    try:
        config = importlib.import_module("torch.utils.serialization.config")
    except ImportError:  # a torch without the serialization config computes the CRC: correct, only slower
        return contextlib.nullcontext()
    if not hasattr(config, "save") or not hasattr(config.save, "compute_crc32"):
        return contextlib.nullcontext()
    patch: Callable[[dict[str, object]], contextlib.AbstractContextManager[object]] = getattr(config, "patch")  # noqa: B009
    return patch({"save.compute_crc32": False})


class CheckpointStore:
    """The checkpoints under ``root`` (``$HPC_ELASTIC_JOB_DIR/checkpoints``), shared by all ranks of a job.

    ``on_phase`` is a fault-injection hook for tests: it is called with ``"tmpdir"``, ``"partial:<file>"`` (after the
    first bytes of a shard reached the disk), ``"file:<file>"``, ``"part"``, ``"manifest"`` (before the rename),
    ``"renamed"`` and ``"pruned"``.
    """

    def __init__(
        self,
        root: Path | str,
        collective: Collective | None = None,
        *,
        keep: int = DEFAULT_KEEP,
        commit_timeout_s: float = DEFAULT_COMMIT_TIMEOUT_S,
        on_phase: Callable[[str], None] | None = None,
    ) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive integer, got {keep!r}")
        if not commit_timeout_s > 0:
            raise ValueError(f"commit_timeout_s must be positive, got {commit_timeout_s!r}")
        self.root = Path(root)
        self.collective: Collective = collective if collective is not None else LocalCollective()
        self.keep = keep
        self.commit_timeout_s = float(commit_timeout_s)
        self._on_phase = on_phase
        self._pending: PendingSave | None = None

    @property
    def rank(self) -> int:
        return self.collective.rank

    def _phase(self, name: str) -> None:
        if self._on_phase is not None:
            self._on_phase(name)

    # -- saving ---------------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        shard: Any,
        *,
        meta: Mapping[str, Any] | None = None,
        mode: SaveMode | str = SaveMode.SYNC,
    ) -> PendingSave:
        """Save this rank's ``shard`` (``None``: nothing from this rank) as part of checkpoint ``step``.

        Collective.  ``meta`` (JSON-serialisable; rank 0's is used) goes into the manifest.  In ``sync`` mode the
        checkpoint is committed when this returns; in ``async`` mode call :meth:`wait` (the next save does)."""
        layout.check_step(step)
        try:
            save_mode = SaveMode(mode)
        except ValueError:
            raise ValueError(f"mode must be sync or async, got {mode!r}") from None
        self.wait()
        coll = self.collective
        meta_doc = dict(meta or {})
        # Check locally, then agree, so that a bad shard on one rank raises on every rank instead of leaving the
        # others blocked in the next collective.  The same exchange carries rank 0's token for the temp directory.
        problem: str | None = None
        try:
            json.dumps(meta_doc)
            if shard is not None:
                check_loadable(shard, "shard")
        except (TypeError, ValueError) as exc:
            problem = f"rank {coll.rank}: {exc}"
        exchanged = coll.allgather_object((problem, secrets.token_hex(6) if coll.rank == 0 else ""))
        problems = [p for p, _ in exchanged if p is not None]
        if problems:
            raise ValueError(f"checkpoint of step {step} refused: {'; '.join(problems)}")
        token: str = exchanged[0][1]
        final = self.root / layout.dir_name(step)
        tmp = self.root / layout.tmp_dir_name(step, token)
        with contextlib.suppress(OSError):  # a failure shows when the shard is written: every rank learns of it
            if coll.rank == 0 and not self.root.is_dir():  # the first save: make the new directory durable
                self.root.mkdir(parents=True, exist_ok=True)
                fsync_dir(self.root.parent)
            elif coll.rank == 0:  # a killed save's partial copy would otherwise hold its space until a commit
                self._sweep(tmp, keep={path for _, path in self._committed_dirs()})
            tmp.mkdir(parents=True, exist_ok=True)
        self._phase("tmpdir")
        pending = PendingSave(step, final, tmp, None)
        if save_mode is SaveMode.ASYNC:
            host = to_host(shard)
            thread = threading.Thread(
                target=self._write_async,
                args=(pending, host, meta_doc),
                name=f"hpc-elastic-ckpt-{step}",
                daemon=False,  # a process that exits without wait() still finishes writing
            )
            pending.thread = thread
            self._pending = pending
            thread.start()
            return pending
        entries: dict[str, FileEntry] | str
        try:
            entries = self._write_shard(tmp, shard)
        except Exception as exc:
            entries = f"rank {coll.rank}: {exc}"
        gathered = coll.gather_object(entries, root=0)
        outcome: str | None = None
        if gathered is not None:  # rank 0
            outcome = self._commit_gathered(pending, gathered, meta_doc)
        outcome = coll.broadcast_object(outcome)
        if outcome is not None:
            raise CheckpointError(f"checkpoint of step {step} failed: {outcome}")
        return pending

    def wait(self) -> Path | None:
        """Finish the asynchronous save in flight, if any (collective); return its committed path.  Raise
        :class:`CheckpointError` on every rank when any rank failed."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        if pending.thread is not None:
            pending.thread.join()
        coll = self.collective
        any_failed = coll.allreduce_max_int(0 if pending.error is None else 1)
        outcome = coll.broadcast_object(pending.error if coll.rank == 0 else None)
        if any_failed or outcome is not None:
            why = outcome or pending.error or "another rank failed"
            raise CheckpointError(f"checkpoint of step {pending.step} failed: {why}")
        return pending.path

    @property
    def pending(self) -> PendingSave | None:
        return self._pending

    def _write_shard(self, tmp: Path, shard: Any) -> dict[str, FileEntry]:
        if shard is None:
            return {}
        torch = torch_module()
        name = layout.shard_name(self.collective.rank)
        with (
            open(tmp / name, "wb") as fh,
            HashingWriter(fh, on_first_write=lambda: self._phase(f"partial:{name}")) as writer,
            _without_zip_crc32(),
        ):
            torch.save(shard, cast(IO[bytes], writer))
            fh.flush()
            os.fsync(fh.fileno())
        self._phase(f"file:{name}")
        return {name: FileEntry(writer.hexdigest(), writer.size)}

    def _write_async(self, pending: PendingSave, host: Any, meta: dict[str, Any]) -> None:
        rank, world = self.collective.rank, self.collective.world_size
        part: dict[str, Any]
        try:
            entries = self._write_shard(pending.tmp, host)
            part = {"files": {n: {"sha256": e.sha256, "size": e.size} for n, e in entries.items()}}
        except Exception as exc:
            pending.error = f"rank {rank}: {exc}"
            part = {"error": pending.error}
        try:
            atomic_write_bytes(pending.tmp / _part_name(rank), json.dumps(part).encode())
            self._phase("part")
        except Exception as exc:
            pending.error = pending.error or f"rank {rank}: {exc}"
        if rank != 0 or pending.error is not None:
            return
        try:
            gathered = self._collect_parts(pending.tmp, world)
        except Exception as exc:
            pending.error = str(exc)
            return
        pending.error = self._commit_gathered(pending, gathered, meta)

    def _collect_parts(self, tmp: Path, world: int) -> list[dict[str, FileEntry] | str]:
        deadline = time.monotonic() + self.commit_timeout_s
        out: list[dict[str, FileEntry] | str] = []
        for rank in range(world):
            path = tmp / _part_name(rank)
            while not path.exists():
                if time.monotonic() > deadline:
                    raise CheckpointError(f"rank {rank} did not finish its shard in {self.commit_timeout_s:.0f} s")
                time.sleep(_POLL_S)
            doc = json.loads(path.read_text())
            if "error" in doc:
                out.append(str(doc["error"]))
            else:
                out.append({n: FileEntry(e["sha256"], int(e["size"])) for n, e in doc["files"].items()})
        return out

    def _commit_gathered(
        self, pending: PendingSave, gathered: list[dict[str, FileEntry] | str], meta: dict[str, Any]
    ) -> str | None:
        """Rank 0: write the manifest and publish the checkpoint.  Return an error message, or ``None``."""
        errors = [g for g in gathered if isinstance(g, str)]
        if errors:
            shutil.rmtree(pending.tmp, ignore_errors=True)
            return "; ".join(errors)
        files: dict[str, FileEntry] = {}
        for entries in gathered:
            if not isinstance(entries, str):
                files.update(entries)
        try:
            self._publish(pending, Manifest(pending.step, len(gathered), time.time(), files, meta))
        except Exception as exc:
            return f"commit: {exc}"
        return None

    def _publish(self, pending: PendingSave, manifest: Manifest) -> None:
        tmp, final = pending.tmp, pending.path
        for rank in range(manifest.world_size):
            (tmp / _part_name(rank)).unlink(missing_ok=True)
        fsync_dir(tmp)
        atomic_write_bytes(tmp / layout.MANIFEST, manifest.to_json().encode())
        self._phase("manifest")
        # Checkpoints at this step or later belong to a timeline this run abandoned (it resumed from an earlier
        # one, e.g. because they were corrupt, or unreadable by another incarnation): move them aside, kept for
        # the user to inspect or restore, never deleted by an older timeline's commit; then publish.
        replaced: list[Path] = []
        for step, path in self._committed_dirs():
            if step > pending.step:
                self._set_aside(path)
            elif step == pending.step:  # the same step again (a retried save, a stop at resume): the old copy stays
                replaced.append(self._replace_aside(path))  # loadable until the new one has its name
        os.rename(tmp, final)
        fsync_dir(self.root)
        self._phase("renamed")
        for path in replaced:
            shutil.rmtree(path, ignore_errors=True)
        self.prune(exclude=tmp)
        self._phase("pruned")

    def _set_aside(self, path: Path) -> None:
        aside = path.with_name(f"{layout.ABANDONED_PREFIX}{path.name}-{secrets.token_hex(4)}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(path, aside)
            fsync_dir(path.parent)

    def _replace_aside(self, path: Path) -> Path:
        """Rename a committed checkpoint of the step being published to ``.replaced-ckpt-<step>-<token>``: no
        longer its step's name, still a candidate to load until the new one has it."""
        aside = path.with_name(f"{layout.REPLACED_PREFIX}{path.name}-{secrets.token_hex(4)}")
        if layout.step_of(path.name) is None:  # itself an orphan of an earlier interrupted replacement
            aside = path
        else:
            os.rename(path, aside)
            fsync_dir(path.parent)
        self._phase("replaced")
        return aside

    def _discard(self, path: Path) -> None:
        trash = path.with_name(f"{layout.TRASH_PREFIX}{path.name}-{secrets.token_hex(4)}")
        try:
            os.rename(path, trash)
        except FileNotFoundError:
            return
        fsync_dir(path.parent)
        shutil.rmtree(trash, ignore_errors=True)

    def prune(self, exclude: Path | None = None) -> list[int]:
        """Delete all but the newest ``keep`` checkpoints with a valid manifest, and leftovers of interrupted saves
        (other than ``exclude``).  Rank 0 only, with no save in flight.  Return the steps deleted."""
        committed = self._committed_dirs()
        valid: dict[int, Path] = {}
        unknown: set[int] = set()  # cannot be read now: neither counted nor deleted
        for step, path in committed:
            try:
                layout.parse_manifest((path / layout.MANIFEST).read_text())
            except (FileNotFoundError, UnicodeDecodeError, ValueError):
                continue
            except OSError:
                unknown.add(step)
                continue
            valid[step] = path
        newest = max(valid, default=-1)
        doomed = layout.to_prune(valid, self.keep)
        for step in doomed:
            self._discard(valid[step])
        for step, path in committed:  # never-valid directories older than the newest good one
            if step not in valid and step not in unknown and step < newest:
                self._discard(path)
        self._sweep(exclude, keep={path for _, path in committed})
        return doomed

    def _sweep(self, exclude: Path | None, keep: set[Path]) -> None:
        """Delete the leftovers of interrupted saves and prunes (not ``exclude``, the save in flight, nor the
        replaced checkpoints in ``keep``, still candidates)."""
        if self.root.is_dir():
            for entry in self.root.iterdir():
                if layout.is_scratch(entry.name) and entry != exclude and entry not in keep and entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)

    # -- loading --------------------------------------------------------------------------------------------

    def _committed_dirs(self) -> list[tuple[int, Path]]:
        """``(step, path)`` of every ``ckpt-*`` directory, and of every replaced one whose step has none (a save
        killed between setting it aside and publishing its successor), newest first (validity not checked)."""
        if not self.root.is_dir():
            return []
        out, replaced = [], []
        for entry in self.root.iterdir():
            step = layout.step_of(entry.name)
            if step is not None and entry.is_dir():
                out.append((step, entry))
            elif (old := layout.replaced_step(entry.name)) is not None and entry.is_dir():
                replaced.append((old, entry))
        published = {step for step, _ in out}
        out += [(step, path) for step, path in replaced if step not in published]
        return sorted(out, reverse=True)

    def steps(self) -> list[int]:
        """Steps of the checkpoint directories present, newest first (validity not checked)."""
        return [s for s, _ in self._committed_dirs()]

    def latest(self, *, verify: bool = True) -> Checkpoint | None:
        """The newest valid checkpoint (this process alone: no collective); ``verify`` hashes every file."""
        for _, path in self._committed_dirs():
            try:
                ckpt = open_checkpoint(path)
                if verify:
                    ckpt.verify()
            except CorruptCheckpoint:
                continue
            return ckpt
        return None

    def load_latest(self, load: Callable[[Checkpoint], T]) -> tuple[Checkpoint, T] | None:
        """Load the newest checkpoint every rank can load (collective).

        ``load`` runs on every rank with the candidate checkpoint and reads what that rank needs (through
        :meth:`Checkpoint.load_shard`, which verifies hashes).  When any rank finds the candidate corrupt, all
        ranks move on to the previous one.  Any other exception in ``load`` is raised on every rank.
        Return ``None`` when no checkpoint is usable."""
        coll = self.collective
        names: list[str] | None = coll.broadcast_object(
            [p.name for _, p in self._committed_dirs()] if coll.rank == 0 else None
        )
        for name in names or []:
            error: Exception | None = None
            code = 0
            result: tuple[Checkpoint, T] | None = None
            try:
                ckpt = open_checkpoint(self.root / name)
                result = (ckpt, load(ckpt))
            except CorruptCheckpoint as exc:
                code, error = 1, exc
            except Exception as exc:
                code, error = 2, exc
            worst = coll.allreduce_max_int(code)
            if worst == 0 and result is not None:
                return result
            if worst == 2:
                if error is not None and code == 2:
                    raise error
                raise CheckpointError(f"another rank failed to load checkpoint {self.root / name}")
        return None
