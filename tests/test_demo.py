"""``python -m ddp_fusion`` (ddp_fusion/demo.py): ``--help`` shows every option's help
and default; nonsensical values are refused by argparse, naming the option, before any
rank starts; and a small run prints only the demo's own lines, with all-reduces per step
counted exactly (one per bucket, eager reducer and fused; one per gradient, unfused),
and keeps its dumps only where ``--dump-dir`` asked for them."""

import json
import os
import re
import subprocess
import sys

import pytest

from ddp_fusion import demo

OPTIONS = ("--algorithm", "--bucket-cap-mb", "--width", "--depth", "--batch", "--steps", "--dump-dir")


class _SpawnedError(Exception):
    pass


def _main(monkeypatch, *argv):
    """``main()`` with ``argv``; ranks are never started (a refusal must come first)."""

    def no_ranks(*args, **kwargs):
        raise _SpawnedError

    monkeypatch.setattr(demo, "run_ranks", no_ranks)
    monkeypatch.setattr(sys, "argv", ["python -m ddp_fusion", *argv])
    demo.main()


def test_help_shows_each_option_with_help_and_default(monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, "--help")
    assert e.value.code == 0
    text = capsys.readouterr().out
    # one block per option: its line, and the lines of its help below it
    blocks = re.split(r"\n(?=  -)", text.split("options:", 1)[1])
    for option in OPTIONS:
        (block,) = [b for b in blocks if re.match(rf"\s*{option}\b", b)]
        words = block.replace(option, "").replace(option.lstrip("-").upper().replace("-", "_"), "")
        assert "(default:" in block, block
        assert len(re.findall(r"[a-z]{3,}", words.split("(default:")[0])) >= 2, block  # a help text


@pytest.mark.parametrize(
    "argv",
    [
        ("--steps", "0"),
        ("--steps", "-3"),
        ("--steps", "2.5"),
        ("--width", "0"),
        ("--depth", "-1"),
        ("--batch", "0"),
        ("--bucket-cap-mb", "0"),
        ("--bucket-cap-mb", "-1"),
        ("--bucket-cap-mb", "nan"),
        ("--bucket-cap-mb", "inf"),
    ],
)
def test_nonsensical_values_are_refused_naming_the_option(monkeypatch, capsys, argv):
    with pytest.raises(SystemExit) as e:
        _main(monkeypatch, *argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[0]}" in err, err


def test_good_values_reach_the_ranks(monkeypatch):
    with pytest.raises(_SpawnedError):
        _main(monkeypatch, "--steps", "1", "--width", "8", "--depth", "1", "--batch", "1",
              "--bucket-cap-mb", "0.5", "--algorithm", "coalesced")


def test_small_run_prints_only_its_own_lines_and_counts_all_reduces_exactly(tmp_path):
    """2 gloo ranks, 2 x Linear(8, 8): 4 gradients (weights 256 bytes, biases 32) in 2
    buckets of at most 0.0003 MB (314 bytes) whatever order they are ready in. The dumps
    asked for with --dump-dir are kept."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("DDP_FUSION", None)
    dumps = tmp_path / "dumps"
    cmd = [sys.executable, "-m", "ddp_fusion", "--width", "8", "--depth", "2", "--batch", "2",
           "--steps", "2", "--bucket-cap-mb", "0.0003", "--dump-dir", str(dumps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-5000:]
    # torch's own line, not ddp_fusion's: Inductor compiling for the CPU with a CUDA build
    # of torch on a machine without a GPU (the 2.11, 2.12 and 2.14 wheels here) logs it
    torch_own = "No CUDA runtime is found, using CUDA_HOME="
    assert [line for line in proc.stderr.splitlines() if torch_own not in line] == [], proc.stderr[-5000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("ddp_fusion demo: 2 x Linear(8, 8) on 2 gloo ranks"), lines
    own = (r"ddp_fusion demo: ", r"$", r"bucket plan \(rank 0", r"  bucket \d+: ", r"mode ",
           r"(eager_reducer|unfused|fused) +\d+ ", r"fused issues ")
    stray = [line for line in lines if not any(re.match(p, line) for p in own)]
    assert not stray, proc.stdout
    buckets = sum(1 for line in lines if re.match(r"  bucket \d+: ", line))
    assert buckets == 2, proc.stdout
    counts = {m: int(c) for m, c in re.findall(r"^(eager_reducer|unfused|fused) +(\d+) ", proc.stdout, re.M)}
    assert counts == {"eager_reducer": buckets, "unfused": 4, "fused": buckets}, proc.stdout
    assert lines[-1] == (f"fused issues 2 all-reduces per step where unfused issues 4 (both compiled "
                         f"autograd); dumps in {dumps}"), proc.stdout
    assert list(dumps.glob("rank0_*.buckets.json")), list(dumps.iterdir())


def test_without_dump_dir_the_dumps_are_removed(monkeypatch, capsys):
    """The ranks (here a stand-in that writes what they would) dump into a temporary
    directory, which is gone once the demo has printed the plan from it."""
    used = []

    def ranks(fn, world_size, args, timeout):
        dump_dir = args[1]
        used.append(dump_dir)
        plan = {"algorithm": "concat", "unfused": [], "buckets": [
            {"num_grads": 1, "bytes": 32, "dtype": "float32", "group": "0", "grads": ["0.bias"]}]}
        with open(os.path.join(dump_dir, "rank0_000_0_1_steady.buckets.json"), "w") as f:
            json.dump(plan, f)
        result = {"step_ms": 1.0, "spread_ms": 0.1, "collectives": 1, "compile_s": 1.0, "num_params": 1}
        return [{mode: result for mode in demo.MODES}]

    monkeypatch.setattr(demo, "run_ranks", ranks)
    monkeypatch.setattr(sys, "argv", ["python -m ddp_fusion"])
    demo.main()
    (dump_dir,) = used
    assert not os.path.exists(dump_dir)
    out = capsys.readouterr().out
    assert "  bucket 0:   1 grads" in out and "dumps in" not in out, out
