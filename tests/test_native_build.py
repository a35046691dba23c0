"""Building the C++ part (ddp_fusion/_native.py) never hangs and never loads another
build: a directory per torch build, Python and source; a dead build's lock file does
not block; a live build that holds the lock past the bound gives the Python path, with
the lock's path in the reason."""

import os
import subprocess
import sys
import textwrap

import torch

from ddp_fusion import _native


def test_each_torch_and_source_builds_in_a_directory_of_its_own(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    first = _native.build_directory()
    assert os.path.dirname(first) == str(tmp_path)
    assert os.path.basename(first).startswith("ddp_fusion_host_check_")
    assert _native.build_directory() == first
    monkeypatch.setattr(torch, "__version__", "2.99.0+other")
    other_torch = _native.build_directory()
    monkeypatch.undo()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    source = tmp_path / "host_check.cpp"
    source.write_text(open(_native.SOURCE).read() + "\n// changed\n")
    monkeypatch.setattr(_native, "SOURCE", str(source))
    assert len({first, other_torch, _native.build_directory()}) == 3


def test_a_dead_builds_lock_file_does_not_block_loading():
    """torch up to 2.13 waits, without a timeout, while a ``lock`` file exists in the
    build directory; a build killed half-way leaves one (and torch 2.14 leaves it after
    every build). Before the build directory was ddp_fusion's own, such a file left by
    torch 2.14 hung every later job on 2.11-2.13 in its first step."""
    directory = _native.build_directory()
    os.makedirs(directory, exist_ok=True)
    open(os.path.join(directory, "lock"), "w").close()
    code = "from ddp_fusion import _native; m = _native.load(); print(m is not None, _native.failure())"
    got = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240)
    assert got.stdout.startswith("True None"), got.stdout + got.stderr[-3000:]


def test_a_build_held_past_the_bound_gives_the_python_path_naming_the_lock(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    directory = _native.build_directory()
    os.makedirs(directory)
    lock = os.path.join(directory, "build.lock")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        f = open({lock!r}, "a")
        fcntl.lockf(f, fcntl.LOCK_EX)
        print("held", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        monkeypatch.setattr(_native, "BUILD_WAIT_S", 0.5)
        monkeypatch.setattr(_native, "_failure", [])
        assert _native.load.__wrapped__() is None
        assert lock in _native.failure()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def test_a_file_system_without_locks_builds_under_torchs_lock_alone(monkeypatch):
    """NFS mounted ``nolock`` answers ``lockf`` with ENOLCK: the build goes on as torch's
    own builds do, rather than giving up the C++ part."""
    import errno

    def no_locks(*args):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(_native.fcntl, "lockf", no_locks)
    monkeypatch.setattr(_native, "_failure", [])
    assert _native.load.__wrapped__() is not None, _native.failure()
