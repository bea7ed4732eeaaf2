"""The probe process (docs/kernels.md#safety): every kernel check a run needs, in one short-lived subprocess, its
verdicts cached on disk per versions, and its own failures told apart from the kernels'.

:func:`probe_batch` looks each :class:`~loongtrain.attn.kernel_probe.ProbeSpec` up in this process's verdicts,
then in the cache file of these versions (torch's build, cuDNN, the CUDA driver, the device's name:
:func:`cache_path`), and runs the rest in ``python -m loongtrain.attn.probe_process`` (its protocol lines:
:mod:`loongtrain.attn.probe_process`):

- a spec whose check prints a verdict gets it (None: passed; else the one line of why);
- a spec the process was running when it died (a signal, a non-zero status: a sticky illegal address) or that
  did not finish within ``timeout_s`` is refused with one line naming the crash or the timeout, and a new process
  checks the specs after it;
- a process that cannot start (an import error, a device in exclusive-process mode, a device that cannot be used)
  or that runs out of memory is a :class:`ProbeError` naming it: not a verdict on any kernel.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from loongtrain.attn.kernel_probe import PROBE_TIMEOUT_S, ProbeSpec, Versions
from loongtrain.attn.probe_process import BEGIN, ERROR, READY, VERDICT, spec_json

PROBE_COMMAND = (sys.executable, "-m", "loongtrain.attn.probe_process")
START_TIMEOUT_S = 120.0  # torch's import and the device's context in the probe process
CACHE_VERSION = 2  # the cases' version: verdicts of other cases are not reused
_VERDICTS: dict[tuple[str, str], str | None] = {}  # (versions' cache name, spec key) -> verdict, this process


class ProbeError(RuntimeError):
    """The probe process failed for its own reasons (not a kernel's): the message names it and what to do."""


def default_cache_dir() -> Path:
    """Where verdicts are kept between runs: ``$XDG_CACHE_HOME/loongtrain``, else ``~/.cache/loongtrain``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "loongtrain"


def cache_name(versions: Versions) -> str:
    """The cache file's name for ``versions`` (the probe's cases' version included)."""
    fields = json.dumps([versions.build, versions.cudnn, versions.driver, versions.gpu, CACHE_VERSION])
    return f"kernel-probes-{hashlib.sha256(fields.encode()).hexdigest()[:16]}.json"


def cache_path(cache_dir: Path, versions: Versions) -> Path:
    return Path(cache_dir) / cache_name(versions)


def _read_cache(path: Path) -> dict[str, str | None]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    verdicts = data.get("verdicts") if isinstance(data, dict) else None
    return {k: v for k, v in verdicts.items() if v is None or isinstance(v, str)} if isinstance(verdicts, dict) else {}


def _write_cache(path: Path, versions: Versions, verdicts: dict[str, str | None]) -> None:
    """Merge ``verdicts`` into ``path`` (written whole under a temporary name, then renamed: a reader never sees a
    partial file). A directory that cannot be written keeps the verdicts in this process only."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        merged = {**_read_cache(path), **verdicts}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"versions": asdict(versions), "cases_version": CACHE_VERSION,
                                   "verdicts": merged}, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass


def probe_batch(specs: Sequence[ProbeSpec], versions: Versions, command: Sequence[str] = PROBE_COMMAND,
                cache_dir: Path | None = None, timeout_s: float = PROBE_TIMEOUT_S,
                start_timeout_s: float = START_TIMEOUT_S) -> dict[str, str | None]:
    """``spec.key() -> verdict`` for every spec (module docstring): this process's verdicts, then ``cache_dir``'s
    file for ``versions`` (None: no file), then one probe process for the rest (more only after a crash or a
    timeout). Raises :class:`ProbeError` when the process fails for its own reasons."""
    name = cache_name(versions)
    out: dict[str, str | None] = {}
    for spec in specs:
        if (name, spec.key()) in _VERDICTS:
            out[spec.key()] = _VERDICTS[(name, spec.key())]
    path = cache_path(cache_dir, versions) if cache_dir is not None else None
    if path is not None and len(out) < len(specs):
        on_disk = _read_cache(path)
        out.update({s.key(): on_disk[s.key()] for s in specs if s.key() in on_disk})
    fresh: dict[str, str | None] = {}
    todo = list(dict.fromkeys(s for s in specs if s.key() not in out))
    while todo:
        got = _run_process(todo, command, timeout_s, start_timeout_s)
        fresh.update(got)
        todo = [s for s in todo if s.key() not in got]
    out.update(fresh)
    _VERDICTS.update({(name, k): v for k, v in out.items()})
    if path is not None and fresh:
        _write_cache(path, versions, fresh)
    return out


def clear_verdicts() -> None:
    """Forget this process's verdicts (the cache files stay)."""
    _VERDICTS.clear()


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line.rstrip("\n"))
    lines.put(None)


def _tail(stream, keep: deque) -> None:
    for line in stream:
        if line.strip():
            keep.append(line.strip())


def _run_process(specs: list[ProbeSpec], command: Sequence[str], timeout_s: float,
                 start_timeout_s: float) -> dict[str, str | None]:
    """One probe process over ``specs`` in order: the verdicts it gave, and the crash or timeout verdict of the
    spec it died on (the specs after it are left for another process). :class:`ProbeError` for its own
    failures."""
    by_key = {s.key(): s for s in specs}
    proc = subprocess.Popen([*command, spec_json(specs)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    stderr: deque = deque(maxlen=20)
    threads = [threading.Thread(target=_reader, args=(proc.stdout, lines), daemon=True),
               threading.Thread(target=_tail, args=(proc.stderr, stderr), daemon=True)]
    for t in threads:
        t.start()
    verdicts: dict[str, str | None] = {}
    ready, current, error = False, None, None
    deadline = time.monotonic() + start_timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            proc.kill()
            proc.wait()
            if not ready:
                raise ProbeError(f"the kernel probe process ({' '.join(command[:3])}) did not start within "
                                 f"{start_timeout_s:.0f} s{_said(stderr)}") from None
            if current is None:  # between specs: the process hung on its own
                raise ProbeError(f"the kernel probe process stopped answering after {len(verdicts)} verdict(s)"
                                 f"{_said(stderr)}") from None
            spec = by_key[current]
            verdicts[current] = f"{spec.kernel} ({spec.kind}) probe did not finish in {timeout_s:.0f} s"
            return verdicts
        if line is None:
            break
        tag, _, payload = line.partition(" ")
        if tag == READY:
            ready = True
        elif tag == BEGIN:
            current = payload.strip()
        elif tag == VERDICT:
            record = json.loads(payload)
            verdicts[record["key"]], current = record["reason"], None
        elif tag == ERROR:
            error = json.loads(payload)
        deadline = time.monotonic() + (timeout_s if ready else start_timeout_s)
    proc.wait()
    for t in threads:
        t.join(timeout=5)
    if error is not None:
        raise ProbeError(f"the kernel probe process failed for its own reasons while checking {error['key']}: "
                         f"{error['error']} (not a verdict on the kernel; free device memory, or run with fewer "
                         f"processes on the device)")
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit status {proc.returncode}"
    if not ready:
        hint = (" (a device in exclusive-process compute mode admits one process: set the default mode, nvidia-smi "
                "-c DEFAULT, or run the probes before anything else holds the device)"
                if any("busy or unavailable" in x for x in stderr) else "")
        raise ProbeError(f"the kernel probe process could not start ({how}){_said(stderr)}{hint}")
    if current is not None:  # it died checking this spec: a fault of that kernel
        spec = by_key[current]
        last = stderr[-1][:300] if stderr else "no output"
        verdicts[current] = f"{spec.kernel} ({spec.kind}) probe crashed ({how}): {last}"
    elif proc.returncode != 0 and len(verdicts) < len(specs):
        raise ProbeError(f"the kernel probe process ended ({how}) between checks{_said(stderr)}")
    return verdicts


def _said(stderr: deque) -> str:
    return f": {stderr[-1][:300]}" if stderr else ""
