"""The C++ part of the host group and the per-step plan check (``csrc/host_check.cpp``),
built on first use.

A steady step's plan check, written in Python, cost about 7 % of a small model's step on
2 gloo ranks: two Python ops entered cold between Inductor's kernels, and their work
(bench/results/plan_check_price_cpu_2026-11-28.md); and the rounds of a host group's
max, run by a Python thread, would wait for the GIL that backward holds. The extension
runs each host group's max on a C++ thread of its own over the host gloo group (which
the Python exchanges post to as well), and kernels of the plan ops for a plan already
checked once, which run no Python (plan_check.py).

It is built with ``torch.utils.cpp_extension.load`` the first time a process needs it:
a C++ compiler and ``ninja`` (a dependency); about 25 s the first time on a machine,
then loaded from torch's extension cache (``TORCH_EXTENSIONS_DIR``). Where it cannot be
built, or ``ddp_fusion.config.native_check`` is False, the same exchanges run in Python,
with the same messages: ranks with and without it work together.

The build has a directory of its own for each torch build, Python and source
(``ddp_fusion_host_check_<hash>`` under the cache's root), so no process loads a module
built for another torch or from another source, and the lock file a torch leaves there
cannot block another. torch up to 2.13 takes the existence of the ``lock`` file in a
build directory as the lock (``FileBaton``, which waits without a timeout), so a build
killed half-way blocks every later one; 2.14 holds an OS lock on that file and leaves
the file behind. Every build of ddp_fusion's first takes an OS lock of its own
(``build.lock`` beside it, a POSIX record lock, released by the kernel when its holder
dies), waiting for it at most :data:`BUILD_WAIT_S`; holding it, any ``lock`` file there
is a dead build's, and is removed. A wait that runs out gives the Python path, and the
warning names the lock's path. On a file system without POSIX locks (NFS mounted
``nolock``) the build runs under torch's lock file alone, as torch's own builds do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

SOURCE = os.path.join(os.path.dirname(__file__), "csrc", "host_check.cpp")
NAME = "ddp_fusion_host_check"
FLAGS = ("-O2",)

BUILD_WAIT_S = 300.0
"""How long a process waits for another's build of the same extension (one takes about
25 s on 2 cores) before it runs the Python path."""

_failure: list[str] = []


def build_directory() -> str:
    """Where this torch, Python and source build the extension: one directory each."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    key = hashlib.sha256()
    build = (torch.__version__, str(torch.version.git_version), sys.version, platform.machine(), repr(FLAGS))
    for part in build:
        key.update(part.encode() + b"\0")
    with open(SOURCE, "rb") as f:
        key.update(f.read())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    return os.path.join(root, f"{NAME}_{key.hexdigest()[:16]}")


_CONTENDED = (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK)  # POSIX lets a held lock give either


class _NoLocksError(Exception):
    """The file system of the build directory does not lock (NFS mounted ``nolock``...)."""


@contextlib.contextmanager
def _build_lock(directory: str, wait_s: float) -> Iterator[bool]:
    """Hold ``directory``'s ``build.lock`` (True), or give up after ``wait_s`` (False);
    raises :class:`_NoLocksError` where the file system has no locks."""
    with open(os.path.join(directory, "build.lock"), "a") as f:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in _CONTENDED:
                    raise _NoLocksError(f"{type(e).__name__}: {e}") from e
                if time.monotonic() >= deadline:
                    yield False
                    return
                time.sleep(0.1)
        try:
            yield True
        finally:
            fcntl.lockf(f, fcntl.LOCK_UN)


_in_process = threading.Lock()  # lockf's locks are the process's: one thread at a time here


@functools.cache
def load() -> Any | None:
    """The extension module, built or loaded once per process; None where it cannot be
    (:func:`failure` says why)."""
    try:
        from torch.utils.cpp_extension import load as build

        def built() -> Any:
            return build(NAME, [SOURCE], extra_cflags=list(FLAGS), build_directory=directory, verbose=False)

        directory = build_directory()
        os.makedirs(directory, exist_ok=True)
        with _in_process:
            try:
                with _build_lock(directory, BUILD_WAIT_S) as held:
                    if not held:
                        _failure.append(
                            f"another process has held {os.path.join(directory, 'build.lock')} for "
                            f"over {BUILD_WAIT_S:.0f} s while building the extension; this process "
                            f"goes on without it"
                        )
                        return None
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(directory, "lock"))  # a dead build's: no live one holds it
                    return built()
            except _NoLocksError:
                # no lock of ours: torch's own (its lock file), stale ones included, as before
                return built()
    except Exception as e:  # noqa: BLE001 - the Python path works without it; logged by the caller
        _failure.append(f"{type(e).__name__}: {e}".strip()[:2000])
        return None


def failure() -> str | None:
    """Why :func:`load` gave None (None: it did not, or was not called)."""
    return _failure[0] if _failure else None


def loaded() -> Any | None:
    """The extension module if :func:`load` has built it, without building it."""
    return load() if load.cache_info().currsize else None
