"""``python -m bench.step_time --link``, without a network namespace.

* where a shaped link cannot be made (faked), the command exits non-zero naming what was
  refused and how to run without ``--link``; a missing ``tc`` names iproute2;
* the hidden flag ``--_inside-link`` refuses to run outside the namespace that
  ``--link`` makes (it would change the machine's own loopback);
* rates are checked; a step's time line gives bucket issue positions and waits, and
  draws.
"""

from __future__ import annotations

import pytest

from bench import step_time
from bench._lib import link, timeline


def test_refused_namespace_exits_naming_what_and_how_to_run_without(monkeypatch, capsys):
    refused = "unshare -n (a private network namespace) was refused: unshare failed: Operation not permitted"
    monkeypatch.setattr(link, "check", lambda: refused)
    with pytest.raises(SystemExit) as e:
        step_time.main(["--link", "4gbit", "--quick", "--model", "mlp"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Operation not permitted" in err and "without --link" in err


def test_missing_tc_names_iproute2(monkeypatch):
    monkeypatch.setattr(link.shutil, "which", lambda tool: None if tool == "tc" else f"/usr/bin/{tool}")
    reason = link.check()
    assert reason is not None and "tc not found" in reason and "iproute2" in reason


def test_inside_flag_outside_the_namespace_refuses(monkeypatch):
    monkeypatch.delenv("BENCH_LINK_PARENT_NETNS", raising=False)
    with pytest.raises(SystemExit) as e:
        step_time.main(["--link", "4gbit", "--model", "mlp", "--_inside-link"])
    assert "not in the namespace" in str(e.value.code)
    with pytest.raises(RuntimeError):
        link.set_rate("1gbit")


def test_rates_are_checked(capsys):
    assert link.parse_rates("1gbit, 500mbit") == ["1gbit", "500mbit"]
    assert link.rate_bytes_per_s("4gbit") == 5e8
    with pytest.raises(SystemExit):
        step_time.main(["--link", "4gb"])
    assert "--link" in capsys.readouterr().err


def _trace():
    """Backward 10-40 ms: bucket 0 issued at 15 (on the wire 15-20), bucket 1 at 30
    (30-45); the main thread waits 30-45 (a wait op, as compiled modes have)."""
    return {"wall_ms": 50.0, "phases": {"forward": (1.0, 10.0), "backward": (10.0, 46.0),
                                        "optimizer": (46.0, 50.0)},
            "issues": [(15.0, 15.1), (30.0, 30.1)], "waits": [(30.2, 45.0)],
            "colls": [(15.1, 20.0, 1_000_000), (30.1, 45.0, 5_000_000)], "copy_out": [],
            "checks": [("plan_check_start", 10.1, 10.2)], "gaps": []}


def test_issue_positions_count_only_backward_compute():
    """Waits, issue calls and ddp_fusion's plan check are not compute."""
    t = _trace()
    # backward compute: 10-30.2 and 45-46, less the plan check 10.1-10.2 and the issue
    # calls 15-15.1 and 30-30.1 (20.9 ms); issues at 4.9 and 19.8 ms of it
    assert timeline.issue_positions(t) == pytest.approx([100 * 4.9 / 20.9, 100 * 19.8 / 20.9])
    assert timeline.issuing_ms(t) == pytest.approx(0.2)
    assert timeline.waited_ms(t) == pytest.approx(14.8)


def test_timeline_draws(tmp_path):
    pytest.importorskip("matplotlib")
    summary = {"rows": {"eager_ddp": {"median_ms": 50.0, "hidden": 0.25}, "ddp_fusion_concat": {}}}
    path = tmp_path / "t.png"
    timeline.plot({"eager_ddp": [_trace(), _trace()], "ddp_fusion_concat": [_trace(), _trace()]},
                  summary, str(path), "test")
    assert path.stat().st_size > 10_000
