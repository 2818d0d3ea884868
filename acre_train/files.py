"""Reading files a user may have been handed, and writing when the disk may fill: clear errors, no pickle.

* :func:`read_safetensors`: a damaged or truncated safetensors file is an error naming the file.
* :func:`deepspeed_weights_only`: DeepSpeed's own loaders call ``torch.load(weights_only=False)``,
  which runs any code a crafted ``*_states.pt`` carries. Inside this context every ``torch.load``
  is ``weights_only=True`` with the few DeepSpeed classes its checkpoints hold allowed
  (:data:`DEEPSPEED_GLOBALS`); anything else is refused, naming the file and the object.
* :func:`disk_errors`: "No space left on device" raised anywhere inside becomes :class:`DiskFullError`
  saying what was being written (callers write to temporary names and rename, so nothing
  half-written is left looking complete).
"""

from __future__ import annotations

import errno
import importlib
import os
import pickle
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

if TYPE_CHECKING:  # torch is imported where it is used: the CLI imports this module at start-up
    import torch

# What DeepSpeed ZeRO-1/2 checkpoints pickle besides tensors and containers (found by loading real
# ZeRO-1/2 CPU checkpoints with weights_only=True); all are plain data holders.
DEEPSPEED_GLOBALS = (
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.utils.tensor_fragment.fragment_address",
)


class DamagedFileError(ValueError):
    """A weights file that cannot be read back (truncated, flipped bytes, not safetensors)."""


class UntrustedPickleError(ValueError):
    """A checkpoint file holds a Python object outside the allow-list: it is not loaded."""


class DiskFullError(OSError):
    """The disk filled up while writing."""


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a safetensors file; a damaged file raises :class:`DamagedFileError` naming it."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return load_file(str(path))
    except Exception as exc:  # safetensors raises its own SafetensorError, or OSError / ValueError
        raise DamagedFileError(f"{path} is damaged or truncated ({type(exc).__name__}: {exc}); "
                               "re-create it (re-export / re-save) or restore a good copy") from exc


def _allowed_globals() -> list[type]:
    out = []
    for name in DEEPSPEED_GLOBALS:
        module, _, attr = name.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):  # another DeepSpeed version: that class does not exist
            continue
    return out


@contextmanager
def deepspeed_weights_only() -> Iterator[None]:
    """Run DeepSpeed checkpoint loading with every ``torch.load`` forced to ``weights_only=True``.

    >>> with deepspeed_weights_only():  # doctest: +SKIP
    ...     engine.load_checkpoint(folder)
    """
    import torch

    original = torch.load

    def restricted(f, *args, **kwargs):
        kwargs["weights_only"] = True
        try:
            return original(f, *args, **kwargs)
        except pickle.UnpicklingError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UntrustedPickleError(
                f"{f}: refused to unpickle an object outside the allow-list ({first}). acre-train loads "
                "DeepSpeed checkpoints with weights_only=True; a checkpoint that needs more is either from "
                "another DeepSpeed version or crafted. Export from a checkpoint you trust.") from exc

    allowed = _allowed_globals()
    torch.load = restricted
    try:
        with torch.serialization.safe_globals(allowed):
            yield
    finally:
        torch.load = original


@contextmanager
def disk_errors(what: str) -> Iterator[None]:
    """Turn "no space left on device" into :class:`DiskFullError` naming ``what`` was being written."""
    try:
        yield
    except OSError as exc:
        if exc.errno == errno.ENOSPC or "No space left" in str(exc):
            raise DiskFullError(errno.ENOSPC, f"the disk is full while writing {what}; free space and run "
                                "again (nothing half-written was kept)") from exc
        raise
    except RuntimeError as exc:  # torch.save's stream writer reports a full disk this way, without an errno
        if "write failed" not in str(exc) and "failed writing" not in str(exc):
            raise
        raise DiskFullError(errno.ENOSPC, f"writing {what} failed (torch: {str(exc).splitlines()[-1].strip()[:120]}); "
                            "the disk is likely full: free space and run again (nothing half-written was kept)") from exc


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A hidden temporary path beside ``path`` to write the file to; renamed to ``path`` when the block
    ends, removed if it raises. A reader sees the old file or the new one, never half of it; a full disk
    is a :class:`DiskFullError` naming ``path``. The one way every writer of a single file finishes it.

    >>> with atomic_path("answers.jsonl") as tmp:  # doctest: +SKIP
    ...     tmp.write_text("...")
    """
    import os
    import tempfile

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.partial-", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        with disk_errors(str(path)):
            yield tmp
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the file is an ordinary output
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through :func:`atomic_path`."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def publish_dir(tmp: Path, final: Path) -> None:
    """Put the finished folder ``tmp`` at ``final``: the old one is renamed aside, the new one renamed in,
    then the old one is deleted. A kill at any moment leaves either the old or the new folder complete
    at ``final`` (never a half-deleted one); leftovers are hidden ``.NAME.old-*`` folders, which
    :func:`remove_stale` clears on the next run."""
    import os
    import shutil
    import tempfile

    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.replace(final, old / "x")
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_dir(final: str | Path, what: str | None = None, *, clear_stale: bool = True,
               keep_existing: bool = False) -> Iterator[Path]:
    """A hidden temporary folder beside ``final`` to build a folder in; published at ``final`` with
    :func:`publish_dir` when the block ends, removed if it raises; a full disk is a
    :class:`DiskFullError` naming ``what``. The one way every writer of a folder finishes it.

    ``clear_stale``: first clear what a killed run left beside ``final`` (off where several processes may
    fill one cache at once). ``keep_existing``: if ``final`` appeared meanwhile (another process cached
    the same thing), keep it and drop this one.

    >>> with atomic_dir("checkpoints/export") as tmp:  # doctest: +SKIP
    ...     (tmp / "config.json").write_text("{}")
    """
    import shutil
    import tempfile

    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    if clear_stale:
        remove_stale(final)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.partial-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the folder is an ordinary output
    try:
        with disk_errors(what or str(final)):
            yield tmp
        if not (keep_existing and final.exists()):
            publish_dir(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_stale(final: Path) -> None:
    """Clear the hidden ``.NAME.partial-*`` / ``.NAME.old-*`` folders a killed run left beside ``final``."""
    import shutil

    for pattern in (f".{final.name}.partial-*", f".{final.name}.old-*"):
        for stale in final.parent.glob(pattern):
            shutil.rmtree(stale, ignore_errors=True)


class FolderBusy(ValueError):
    """Another process holds the folder (a run, a preparation, an export or a conversion)."""


class FolderLock:
    """An exclusive OS lock (``flock``) on ``folder`` for the life of a job, held in the hidden file
    ``.NAME.lock`` beside it (the folder itself may not exist yet, or be replaced whole). A second
    process is refused at once, naming the holder's pid; the kernel drops the lock when the holder
    exits, however it exits, so a killed job never leaves a stale lock (only, then, an empty hidden
    file); a job that ends normally removes the file.

    >>> with FolderLock(Path("/tmp/acre-doc-lock")):  # doctest: +SKIP
    ...     ...
    """

    def __init__(self, folder: str | Path, what: str = "folder"):
        folder = Path(folder)
        self.folder, self.what = folder, what
        self.path = folder.parent / f".{folder.name}.lock"
        self._file = None

    def __enter__(self) -> "FolderLock":
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.pread(fd, 64, 0).decode("utf-8", "replace").strip() or "?"
                os.close(fd)
                raise FolderBusy(f"{self.folder} is in use by another {self.what} (pid {holder}); wait for it to "
                                 "finish, or choose another output") from None
            # The holder before us removes the file as it finishes: a lock on that removed file guards
            # nothing (a third process may hold a new one), so hold it only if it is still the file here.
            if _same_file(fd, self.path):
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._file = fd
        return self

    def _open(self) -> int:
        """The lock file, opened without following a link (a planted link would make the lock write the
        pid into whatever it points to) and only if it is a regular file."""
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            fd = os.open(self.path, flags, 0o644)
        except OSError as exc:
            if self.path.is_symlink():
                raise FolderBusy(f"{self.path} (the lock beside {self.folder}) is a symbolic link; acre-train "
                                 "does not write through links: remove it") from None
            if self.path.exists():
                raise FolderBusy(f"{self.path} (the lock beside {self.folder}) is not a regular file: remove it") from None
            raise FolderBusy(f"cannot open the lock file {self.path}: {exc.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise FolderBusy(f"{self.path} (the lock beside {self.folder}) is not a regular file: remove it")
        return fd

    def __exit__(self, *exc) -> None:
        import fcntl

        if self._file is not None:
            # Removed while still held: a process that opened it before finds it gone once it gets the
            # lock and opens again; one that opens it after makes a new file, by which time this job's
            # work is done.
            if _same_file(self._file, self.path):
                self.path.unlink(missing_ok=True)
            fcntl.flock(self._file, fcntl.LOCK_UN)
            os.close(self._file)
            self._file = None


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``path`` (not followed if a link) is the file open as ``fd``."""
    try:
        here = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def cache_root() -> Path:
    """acre-train's cache directory: ``$ACRE_TRAIN_CACHE`` or ``~/.cache/acre-train`` (bases, tokenizers, prep)."""
    env = os.environ.get("ACRE_TRAIN_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "acre-train"
