#!/usr/bin/env python3
"""The tested torch window: the demo and the test suite on each torch release, one fresh
virtual environment per release, and a table of what passed.

    python3 .ci/torch_window.py                                   # 2.11.0 2.12.1 2.13.0 2.14.1,
                                                                  # the whole "not slow" suite
    python3 .ci/torch_window.py --versions 2.14.1 --tests "tests/test_pass_graphs.py"
    python3 .ci/torch_window.py --venvs /tmp/tw --out bench/out/torch_window.md

For each release it makes a virtual environment (kept under ``--venvs`` and reused when it
already holds that torch), installs that torch, then ddp_fusion with its ``test`` extra as
a user would (nothing holds torch: the release fails if pip replaces it), then the
``integrations`` extra under a constraint that keeps that torch: an integration whose
pinned release would replace torch is left out, and its tests skip by name
(``pytest.importorskip``). It checks that the install kept the torch, runs the demo
(``python -m ddp_fusion``: passes when fused issues fewer all-reduces than unfused), and
runs pytest with a JUnit report, from which the table counts passed, failed and skipped
tests and names the failures. Exits non-zero if any release failed anything.

Standard library only (Python 3.11 or later, for ``tomllib``): it runs with the
interpreter that makes the environments. One release at a time (the machine has 2
cores). Each command runs with its environment's ``bin`` first on ``PATH`` and without
the caller's ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import shlex
import subprocess
import sys
import time
import tomllib
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WINDOW = ("2.11.0", "2.12.1", "2.13.0", "2.14.1")
"""The releases of the tested window, oldest first (ddp_fusion/_torch/__init__.py's
TESTED_TORCH holds their minor versions; pyproject.toml's lower bound is the first)."""


@dataclass
class Outcome:
    version: str
    torch: str = "-"
    left_out: list[str] = field(default_factory=list)
    demo: str = "-"
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error and self.failed == 0 and (self.demo == "-" or self.demo.startswith("fused"))


PYTEST_TIMEOUT_S = 3600
"""A release whose tests run longer than this has hung (the whole suite takes about 25
minutes on 2 cores)."""


def _env(venv: Path) -> dict[str, str]:
    """The environment a command in ``venv`` runs with: its own ``bin`` first (torch finds
    ``ninja`` there), nothing from the caller's ``PYTHONPATH`` or virtual environment."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    return env


def _run(cmd: list[str], log, **kw) -> subprocess.CompletedProcess:
    log.write(f"$ {shlex.join(cmd)}\n")
    log.flush()
    return subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                          text=True, **kw)


def _integrations() -> list[str]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["project"]["optional-dependencies"]["integrations"]


def _torch_version(py: Path) -> subprocess.CompletedProcess:
    # run outside the checkout: from its root, the editable install's metadata there
    # (ddp_fusion.egg-info) makes torch load ddp_fusion's entry point into an
    # environment that may not hold ddp_fusion's dependencies yet
    return subprocess.run([str(py), "-c", "import torch; print(torch.__version__)"],
                          capture_output=True, text=True, cwd=py.parent)


def _venv(version: str, base: Path, log) -> Path:
    """A virtual environment holding torch ``version`` (made, or reused)."""
    venv = base / f"torch-{version}"
    py = venv / "bin" / "python"
    if py.exists():
        got = _torch_version(py)
        if got.returncode == 0 and got.stdout.strip().split("+")[0] == version:
            return venv
    _run([sys.executable, "-m", "venv", "--clear", str(venv)], log, check=True)
    _run([str(py), "-m", "pip", "install", "-q", f"torch=={version}"], log, check=True)
    return venv


def _install(venv: Path, version: str, out: Outcome, log, integrations: bool) -> None:
    """ddp_fusion with its test extra and every integration that keeps torch ``version``."""
    py = str(venv / "bin" / "python")
    # ddp_fusion itself as a user installs it, with nothing holding torch: check() then
    # fails the release if pip replaced its torch
    _run([py, "-m", "pip", "install", "-q", "-e", f"{ROOT}[test]"], log, check=True)
    if not integrations:
        out.left_out.append("all (--no-integrations)")
        return
    keep = venv / "keep-torch.txt"
    keep.write_text(f"torch=={version}\n")
    pip = [py, "-m", "pip", "install", "-q", "-c", str(keep)]
    if _run(pip + ["-e", f"{ROOT}[test,integrations]"], log).returncode == 0:
        return
    for requirement in _integrations():
        if _run(pip + [requirement], log).returncode != 0:
            out.left_out.append(requirement)


def _demo(py: str, log) -> str:
    got = subprocess.run([py, "-m", "ddp_fusion"], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, cwd=ROOT, timeout=1800, env=_env(Path(py).parent.parent))
    log.write(got.stdout + got.stderr)
    m = re.search(r"fused issues (\d+) all-reduces per step where unfused issues (\d+)", got.stdout)
    if got.returncode != 0 or not m:
        return f"failed (exit {got.returncode})"
    fused, unfused = int(m.group(1)), int(m.group(2))
    return f"fused {fused} / unfused {unfused}" if fused < unfused else f"not fused ({fused} / {unfused})"


def _count(report: Path, out: Outcome) -> None:
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            out.failed += 1
            out.failures.append(name)
        elif case.find("skipped") is not None:
            out.skipped += 1
        else:
            out.passed += 1


def check(version: str, base: Path, tests: list[str], logs: Path, demo: bool, integrations: bool) -> Outcome:
    out = Outcome(version)
    start = time.monotonic()
    with open(logs / f"torch-{version}.log", "w") as log:
        try:
            venv = _venv(version, base, log)
            py = str(venv / "bin" / "python")
            _install(venv, version, out, log, integrations)
            got = _torch_version(venv / "bin" / "python")
            out.torch = got.stdout.strip() if got.returncode == 0 else f"import failed: {got.stderr[-300:]}"
            if out.torch.split("+")[0] != version:
                out.error = f"the install replaced torch {version} with {out.torch}"
                return out
            if demo:
                out.demo = _demo(py, log)
            report = logs / f"torch-{version}.xml"
            report.unlink(missing_ok=True)  # never count an earlier run's
            code = _run([py, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *tests],
                        log, cwd=ROOT, env=_env(venv), timeout=PYTEST_TIMEOUT_S).returncode
            if report.exists():
                _count(report, out)
            # 0 all passed, 1 some failed; anything else (nothing collected, a path that is
            # not there, an internal error, an interruption) fails the release
            if code not in (0, 1) or (code == 1 and not out.failed) or out.passed == 0:
                out.error = f"pytest exited {code} with {out.passed} passed"
        except (subprocess.SubprocessError, OSError) as e:
            out.error = f"{type(e).__name__}: {e}"
        finally:
            out.seconds = time.monotonic() - start
    return out


def table(outcomes: list[Outcome], tests: list[str]) -> str:
    lines = [
        f"{datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; tests: `pytest {shlex.join(tests)}`",
        "",
        "| torch | demo | passed | failed | skipped | integrations left out | minutes |",
        "|---|---|---:|---:|---:|---|---:|",
    ]
    for o in outcomes:
        lines.append(f"| {o.torch if o.torch != '-' else o.version} | {o.demo} | {o.passed} | {o.failed} | "
                     f"{o.skipped} | {', '.join(o.left_out) or 'none'} | {o.seconds / 60:.1f} |")
    for o in outcomes:
        if o.error:
            lines.append(f"\n{o.version}: {o.error}")
        for name in o.failures:
            lines.append(f"\n{o.version} failed: `{name}`")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--versions", default=",".join(WINDOW), help="comma-separated torch releases")
    parser.add_argument("--tests", default='-m "not slow"', help="pytest arguments (default: %(default)s)")
    default_venvs = Path(os.environ.get("TMPDIR", "/tmp")) / "ddp_fusion_window"
    parser.add_argument("--venvs", type=Path, default=default_venvs,
                        help="where the environments are made and kept (default: %(default)s)")
    parser.add_argument("--no-demo", action="store_true", help="skip the demo")
    parser.add_argument("--no-integrations", action="store_true",
                        help="install the test extra only (the integrations' tests skip)")
    parser.add_argument("--out", type=Path, help="also write the table here")
    args = parser.parse_args()
    tests = shlex.split(args.tests)
    args.venvs.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for version in args.versions.split(","):
        print(f"==== torch {version} (log: {args.venvs / f'torch-{version}.log'})", flush=True)
        outcomes.append(check(version, args.venvs, tests, args.venvs, not args.no_demo,
                              not args.no_integrations))
        o = outcomes[-1]
        print(f"     {o.torch}: demo {o.demo}; {o.passed} passed, {o.failed} failed, {o.skipped} skipped"
              f"{'; ' + o.error if o.error else ''} ({o.seconds / 60:.1f} min)", flush=True)
        if not o.ok:  # the log's end, for a run whose environments are thrown away (CI)
            lines = (args.venvs / f"torch-{version}.log").read_text(errors="replace").splitlines()
            print("\n".join(line for line in lines[-80:] if "is ignored: it is neither" not in line))
    text = table(outcomes, tests)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
    return 0 if all(o.ok for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
