"""The files loongtrain writes (docs/launching.md, docs/data.md): which directories it owns, one writer per
directory, whole files or none, and a full disk named. Every command that writes a directory
(``prepare --out``, ``train --out-dir``, ``eval --out``, ``export --hf``) goes through this module.

**Ownership** (:func:`check_output`; docs/files-and-checkpoints.md#one-ownership-rule). A command
describes its output directory with an :class:`Output`: the command, its flag, and what it writes there, a
:class:`Folder` all the way down (the files of each folder, and each sub-folder with its own contents:
``export``'s ``adapter/`` and ``base/``, ``train``'s ``checkpoints/step_N/``, ``prepare``'s ``shards/``). The
directory is refused (ValueError naming it) when it is an empty path, a file, the current directory or a
parent of it, an input of the command, a directory holding an input, or a directory inside an input
directory. A directory that does not exist or is empty is taken. A non-empty one must be loongtrain's: it
carries :data:`MARKER` naming the command (written when the command first takes the directory) or, for
directories written before the marker existed, the command's own signature; and every entry in it, at every
depth, must be one the command writes (or a directory another loongtrain command marked). Anything else (a
user's file, a link, a file where a folder belongs) is refused, naming the folder and the entries, so
loongtrain never writes among, nor deletes, files it did not write. Deleting (``--overwrite``, a replaced
checkpoint or export, pruning: :func:`remove_owned`, :func:`remove_folder`) removes only what the command
writes and keeps anything else, with a warning.

**One writer** (:class:`OutputLock`). While a command writes a directory it holds an exclusive
``flock`` on ``DIR/.loongtrain.lock``, which records the holder (pid, host, command). A second writer
exits 2 naming that holder. The kernel drops the lock of a process that died, so a stale lock file is
taken over without asking; where ``flock`` is not available the file's pid decides (a dead pid on this
host is taken over, a live one or another host's refuses).

**Whole or nothing** (:func:`write_atomic`): a temporary name in the same directory, then
``os.replace``; on any failure the temporary file is removed. **A full disk** (:func:`disk_space`): an
ENOSPC/EDQUOT becomes :class:`DiskFullError`, one line naming the path, "no space left on device" and
the space free there.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import logging
import os
import shutil
import socket
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not POSIX: the lock file's pid decides
    fcntl = None  # type: ignore[assignment]

log = logging.getLogger("loongtrain")

#: written into every directory a command takes: ``{"command": ...}``
MARKER = ".loongtrain"
#: the lock of the command writing the directory: ``{"pid", "host", "command", "since"}``
LOCK_FILE = ".loongtrain.lock"
#: temporary names of :func:`write_atomic` (every command writes them)
TEMP_PATTERN = ".*.tmp-*"


@dataclass(frozen=True)
class Folder:
    """What a command writes inside one folder: the names of its ``files`` and of its ``folders``, each with
    what it writes inside (``fnmatch`` patterns). Anything else there is not loongtrain's: a user's file, a
    link, a file where a folder belongs or a folder where a file does (:func:`foreign_entries`)."""

    files: tuple[str, ...] = ()
    folders: tuple[tuple[str, Folder], ...] = ()

    def kind(self, entry: Path) -> Folder | bool | None:
        """``True`` when ``entry`` is a file this folder's command writes, its :class:`Folder` when it is a
        folder it writes, None when it is not loongtrain's (a link never is: loongtrain writes none)."""
        name = entry.name
        if entry.is_symlink():
            return None
        if entry.is_dir():
            return next((inner for pattern, inner in self.folders if fnmatch.fnmatchcase(name, pattern)), None)
        return True if any(fnmatch.fnmatchcase(name, p) for p in (*self.files, TEMP_PATTERN)) else None


@dataclass(frozen=True)
class Output:
    """An output directory's owner: ``command`` (``"prepare"`` ...), its ``flag`` (``"--out"``), what it writes
    there (:class:`Folder`, all the way down; its marker and lock besides), and ``signature``: True for a
    directory this command wrote before :data:`MARKER` existed (None: only the marker counts)."""

    command: str
    flag: str
    contents: Folder
    signature: Callable[[Path], bool] | None = None

    @property
    def top(self) -> Folder:
        """:attr:`contents` with the marker and the lock, which only the top level holds."""
        return Folder((MARKER, LOCK_FILE, *self.contents.files), self.contents.folders)

    def owns(self, path: Path) -> bool:
        """True when directory ``path`` is this command's (its marker, or its older signature)."""
        return marker_command(path) == self.command or (self.signature is not None and self.signature(path))


def marker_command(path: Path) -> str | None:
    """The command named by ``path``'s marker (None without a readable one)."""
    try:
        data = json.loads((Path(path) / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return data.get("command") if isinstance(data, dict) else None


def _name(path: str | Path) -> str:
    return repr(str(path))


def check_output(output: Output, path: str | Path, *, inputs: Iterable[str | Path] = ()) -> Path:
    """``path`` as ``output``'s directory, checked by the ownership rule (module docstring); ``inputs``:
    the paths this command reads. ValueError naming the path and the rule otherwise."""
    text, flag = str(path), output.flag
    if not text.strip():
        raise ValueError(f"{flag} {text!r} is empty: name the output directory")
    out = follow_link(flag, text)
    resolved = out.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        raise ValueError(f"{flag} {_name(text)} is the current directory or a parent of it: name a directory "
                         f"of its own")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{flag} {_name(text)} is a file; it must be a directory (or not exist yet)")
    for item in inputs:
        source = Path(item).resolve()
        if source == resolved or resolved in source.parents:
            raise ValueError(f"{flag} {_name(text)} holds {_name(item)}, an input of this command: choose a "
                             f"directory of its own")
        if source.is_dir() and source in resolved.parents:
            raise ValueError(f"{flag} {_name(text)} lies inside {_name(item)}, an input directory of this "
                             f"command: choose a directory outside it")
    if out.is_dir():
        check_owned(output, out)
        holder = lock_holder(out)
        if holder is not None:
            raise ValueError(f"{flag} {_name(text)} is in use by {holder}: wait for it to finish or choose "
                             f"another directory")
    return out


def follow_link(flag: str, text: str | Path) -> Path:
    """The output path ``text`` of option ``flag`` with a link in its last part followed (the output lands
    in the link's target, and the link stays; docs/files-and-checkpoints.md#links); ValueError (one line)
    for a dangling link or a link loop (ELOOP)."""
    path = Path(text)
    try:
        resolved = path.resolve()
        exists = path.exists()
    except (RuntimeError, OSError):  # Python < 3.13: RuntimeError; later: OSError(ELOOP)
        raise ValueError(f"{flag} {_name(text)} is a link loop (ELOOP: too many levels of links): name a real "
                         f"file or directory") from None
    if not path.is_symlink():
        return path
    if not exists:
        raise ValueError(f"{flag} {_name(text)} is a dangling link (to {_name(os.readlink(path))}, which does not "
                         f"exist): create its target or name another path")
    return resolved


#: the first line of every file loongtrain writes outside a directory of its own (``plan --out``)
FILE_HEADER = "# written by `loongtrain "


def check_output_file(flag: str, path: str | Path, command: str, *, inputs: Iterable[str | Path] = (),
                      overwrite: bool = False) -> Path:
    """``path`` as a file ``loongtrain COMMAND`` writes (docs/files-and-checkpoints.md#one-ownership-rule):
    a link is followed; refused (ValueError naming it) when it is a directory, a dangling link or a loop,
    in a directory that does not exist, one of ``inputs``, or an existing file: one loongtrain did not write
    (its first line is not :data:`FILE_HEADER`) always, loongtrain's own without ``overwrite``. Returns
    the path to write (a link's target)."""
    text = str(path)
    if not text.strip():
        raise ValueError(f"{flag} {text!r} is empty: name the file to write")
    out = follow_link(flag, text)
    if out.is_dir():
        raise ValueError(f"{flag} {_name(text)} is a directory; name the file to write")
    if not out.parent.is_dir():
        raise ValueError(f"{flag} {_name(text)}: the directory {_name(out.parent)} does not exist")
    for item in inputs:
        if item and Path(item).exists() and Path(item).resolve() == out.resolve():
            raise ValueError(f"{flag} {_name(text)} is {_name(item)}, an input of this command: name another file")
    if out.exists():
        if not written_by_loongtrain(out):
            raise ValueError(f"{flag} {_name(text)} is a file loongtrain did not write (its first line is not "
                             f"{FILE_HEADER.strip()!r}...); it is never replaced: name a new file")
        if not overwrite:
            raise ValueError(f"{flag} {_name(text)} holds an earlier output of loongtrain; pass --overwrite to "
                             f"replace it or name a new file")
    return out


def written_by_loongtrain(file: Path) -> bool:
    """True when ``file``'s first line is :data:`FILE_HEADER` (a file loongtrain wrote)."""
    try:
        with open(file, "rb") as f:
            return f.read(len(FILE_HEADER)) == FILE_HEADER.encode()
    except OSError:
        return False


def check_owned(output: Output, out: Path) -> None:
    """An existing directory ``out`` is empty, or ``output``'s with nothing else in it, all the way down
    (ValueError naming the first folder that holds something loongtrain did not write, and those entries)."""
    if not any(out.iterdir()):
        return
    foreign = foreign_entries(output, out)
    if foreign:
        where = foreign[0].parent
        names = [p.name for p in foreign if p.parent == where]
        shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
        inside = "" if where == out else f": {_name(where)}"
        raise ValueError(f"{output.flag} {_name(out)}{inside} holds files loongtrain did not write ({shown}); they "
                         f"are never written over or deleted: choose an empty or new directory")
    if not output.owns(out):
        other = marker_command(out)
        whose = f"`loongtrain {other}`'s output" if other else f"without loongtrain's marker {MARKER}"
        raise ValueError(f"{output.flag} {_name(out)} is not an output of `loongtrain {output.command}` ({whose}); "
                         f"loongtrain never writes over such a directory: choose an empty or new directory")


def foreign_entries(output: Output | Folder, out: Path) -> list[Path]:
    """Every entry under directory ``out`` that ``output``'s command did not write, all the way down (a
    directory another loongtrain command marked is not looked into: it is that command's), in the order of a
    sorted walk; empty when the whole tree is loongtrain's (docs/files-and-checkpoints.md#one-ownership-rule)."""
    folder = output.top if isinstance(output, Output) else output
    found: list[Path] = []
    for entry in sorted(Path(out).iterdir()):
        kind = folder.kind(entry)
        if kind is None:
            if not (entry.is_dir() and not entry.is_symlink() and marker_command(entry) is not None):
                found.append(entry)
        elif isinstance(kind, Folder):
            found.extend(foreign_entries(kind, entry))
    return found


def remove_owned(output: Output | Folder, out: Path, keep: Iterable[str] = ()) -> list[str]:
    """Delete what ``output``'s command wrote in directory ``out``, all the way down (never the top-level
    names in ``keep``, nor, for an :class:`Output`, its marker and lock; a folder goes once it is empty);
    return the top-level names deleted. What loongtrain did not write stays, with a warning naming it (the
    checks refused it before: :func:`check_output`; one that appeared since is kept)."""
    folder = output.contents if isinstance(output, Output) else output
    removed = []
    keep = {MARKER, LOCK_FILE, *keep} if isinstance(output, Output) else set(keep)
    for entry in sorted(Path(out).iterdir()):
        kind = folder.kind(entry)
        if entry.name in keep or kind is None:
            continue
        if isinstance(kind, Folder) and not remove_folder(kind, entry):
            continue
        if kind is True:
            entry.unlink()
        removed.append(entry.name)
    return removed


def remove_folder(folder: Folder, path: Path) -> bool:
    """Delete folder ``path``, whose contents ``folder`` describes, as far as loongtrain wrote it
    (:func:`remove_owned`): True when it is gone; False when something it did not write kept it (named in a
    warning)."""
    remove_owned(folder, path)
    left = sorted(p.name for p in path.iterdir())
    if left:
        log.warning("%s: kept, it holds files loongtrain did not write (%s)", path, ", ".join(left[:4]))
        return False
    path.rmdir()
    return True


def remove_output(output: Output, out: Path) -> bool:
    """Delete the whole output directory ``out`` of ``output``'s command (its marker and lock too) as far as
    loongtrain wrote it: True when it is gone, False when a file it did not write kept it (a warning)."""
    return remove_folder(output.top, out)


def write_marker(output: Output, out: Path) -> None:
    """Mark ``out`` as ``output.command``'s (kept when it already is)."""
    if marker_command(out) != output.command:
        write_atomic(out / MARKER, json.dumps({"command": output.command}) + "\n")


# -- one writer ------------------------------------------------------------------------------------------


def _holder_text(info: dict[str, Any] | None, file: Path) -> str:
    if not info:
        return f"another process (lock {file})"
    return (f"`loongtrain {info.get('command', '?')}` (pid {info.get('pid', '?')} on host {info.get('host', '?')}, "
            f"lock {file})")


def _read_holder(file: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(file.read_text() or "null")
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _flock(fd: int) -> bool | None:
    """Take the exclusive flock of ``fd`` without waiting: True taken, False held elsewhere, None when
    this filesystem or platform has no flock."""
    if fcntl is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return None
        raise
    return True


def lock_holder(out: Path) -> str | None:
    """Who holds ``out``'s lock (None: nobody, or this process)."""
    file = Path(out) / LOCK_FILE
    if not file.is_file():
        return None
    info = _read_holder(file)
    if info and info.get("pid") == os.getpid() and info.get("host") == socket.gethostname():
        return None
    try:
        fd = os.open(file, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        taken = _flock(fd)
    finally:
        os.close(fd)  # closing drops a lock just taken: this was only a look
    if taken is None:
        return None if _stale(info) else _holder_text(info, file)
    return None if taken else _holder_text(info, file)


def _stale(info: dict[str, Any] | None) -> bool:
    """Without flock: a lock whose pid is dead on this host is stale (another host's never is)."""
    if not info:
        return True
    return info.get("host") == socket.gethostname() and not _pid_alive(int(info.get("pid", -1)))


class OutputLock:
    """``with OutputLock(output, out):`` creates ``out`` (and its parents), locks it for this process
    (ValueError naming the holder when another one writes it) and marks it as ``output.command``'s;
    on exit the lock file is removed."""

    def __init__(self, output: Output, out: str | Path) -> None:
        self.output, self.out = output, Path(out)
        self.file = self.out / LOCK_FILE
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        self.out.mkdir(parents=True, exist_ok=True)
        for _ in range(8):
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            taken = _flock(fd)
            info = _read_holder(self.file)
            if taken is False or (taken is None and not _stale(info) and info and info.get("pid") != os.getpid()):
                os.close(fd)
                raise ValueError(f"{self.output.flag} {_name(self.out)} is in use by {_holder_text(info, self.file)}: "
                                 f"wait for it to finish or choose another directory")
            try:  # the holder may have removed the file between our open and our lock: lock the new one
                same = os.stat(self.file).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if not same:
                os.close(fd)
                continue
            if info and info.get("pid") not in (None, os.getpid()):
                log.info("%s: taking over the lock of pid %s on %s, which is no longer running", self.out,
                         info.get("pid"), info.get("host"))
            record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": self.output.command,
                                 "since": time.time()}).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, record, 0)
            self._fd = fd
            break
        else:
            raise ValueError(f"{self.output.flag} {_name(self.out)}: could not lock {self.file}")
        try:
            write_marker(self.output, self.out)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            self.file.unlink()  # while still holding it: a waiting writer then re-opens the new file
        os.close(self._fd)
        self._fd = None


# -- whole files, full disks -----------------------------------------------------------------------------


class DiskFullError(OSError):
    """No space left (ENOSPC, or a quota: EDQUOT) while writing ``path``; its text is one line naming the
    path and the space free there."""

    restartable = False  # the disk stays full (parallel/failures.py)

    def __init__(self, path: str | Path, code: int = errno.ENOSPC) -> None:
        super().__init__(code, "no space left on device")
        self.filename = str(path)
        free = _free_bytes(Path(path))
        where = f" ({free / 2**20:.1f} MiB free there)" if free is not None else ""
        self.text = (f"{path}: no space left on device{where}{' (disk quota)' if code == errno.EDQUOT else ''}; "
                     f"free space or write elsewhere")

    def __str__(self) -> str:
        return self.text

    def __reduce__(self) -> tuple[Any, ...]:  # from a worker process: rebuilt from the path
        return DiskFullError, (self.filename, self.errno)


def _free_bytes(path: Path) -> int | None:
    for place in (path, *path.parents):
        if place.exists():
            try:
                return shutil.disk_usage(place).free
            except OSError:
                return None
    return None


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


@contextlib.contextmanager
def disk_space(path: str | Path) -> Iterator[None]:
    """Inside: an OSError of a full disk or quota becomes :class:`DiskFullError` naming the file it names,
    else ``path``."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(exc.filename or path, exc.errno) from None
        raise


def write_bytes(path: str | Path, data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` to ``path`` (a full disk: :class:`DiskFullError`, the partial file removed)."""
    path = Path(path)
    try:
        with disk_space(path), open(path, "wb") as f:
            f.write(data)
    except BaseException:
        with contextlib.suppress(OSError):
            path.unlink()
        raise


def write_atomic(path: str | Path, data: bytes | str) -> None:
    """Replace ``path`` by ``data`` whole: written under a temporary name beside it, then renamed; on any
    failure (a full disk: :class:`DiskFullError`) the temporary file is removed and ``path`` is as it was."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        try:
            write_bytes(tmp, data.encode() if isinstance(data, str) else data)
        except DiskFullError as exc:
            raise DiskFullError(path, exc.errno) from None  # the file it was writing, not its temporary name
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink()


def save_safetensors(state: dict[str, Any], path: str | Path) -> None:
    """``state`` as a safetensors file at ``path``, readable as any file this process creates (``0666`` less
    the umask: safetensors itself leaves its files ``0600``, which a serving process of another user cannot
    read)."""
    from safetensors.torch import save_file

    save_file(state, str(path), metadata={"format": "pt"})
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, 0o666 & ~mask)
