"""The benchmark's argument handling and its per-step accounting, without running it.

The GPU path of ``bench.step_time`` (``--device cuda``: one NCCL rank, synchronised
timing, kernel counts) can only run where a GPU is lent; here it is checked that it is
refused with a clear message where there is none, and that its bookkeeping is right.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.fx.experimental.proxy_tensor import make_fx

import ddp_fusion
from bench import step_time
from bench._lib.models import model_info, world_size
from bench._lib.profiling import graph_stats
from ddp_fusion.passes import fuse_ddp_allreduces


def _main(*argv):
    step_time.main(list(argv))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU-only machine")
def test_cuda_without_a_gpu_is_refused_by_name(capsys):
    with pytest.raises(SystemExit) as e:
        _main("--device", "cuda")
    assert e.value.code == 2
    assert "--device cuda: no CUDA device" in capsys.readouterr().err


def test_unknown_mode_is_refused_with_the_known_ones(capsys):
    with pytest.raises(SystemExit):
        _main("--modes", "eager_ddp,ddp_fusion_concatt")
    err = capsys.readouterr().err
    assert "ddp_fusion_concatt" in err and "ddp_fusion_coalesced" in err


def test_a_gpu_only_mode_is_refused_on_the_cpu_by_name(capsys):
    """Upstream's overlap scheduler estimates runtimes with Triton: GPU only."""
    with pytest.raises(SystemExit) as e:
        _main("--modes", "eager_ddp,upstream_overlap_scheduling")
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "upstream_overlap_scheduling runs on a GPU only" in err and "--device cuda" in err


def test_world_sizes(capsys):
    assert world_size("mlp", "cpu") == 2
    assert world_size("mlp_tp", "cpu") == 4
    assert world_size("gpt", "cuda") == 1
    assert world_size("hf_gpt2", "cpu", 1) == 1  # --world-size 1: host cost without a peer
    with pytest.raises(SystemExit):
        _main("--model", "mlp_tp", "--world-size", "1")
    assert "mlp_tp has its own layout" in capsys.readouterr().err


def test_dp_x_tp_model_holds_tp_shards():
    # 8 blocks: W1 (1024/2 x 256), b1 (512), W2 (256 x 1024/2), b2 (256) per TP rank
    info = model_info("mlp_tp")
    assert info["num_tensors"] == 32
    assert info["num_params"] == 8 * (512 * 256 + 512 + 256 * 512 + 256)


def test_graph_stats_count_the_bucket_copy(fake_pg):
    def backward(w1, w2):
        g1, g2 = w1 * 2, w2 * 3
        return (ddp_fusion.all_reduce_gradient(g1, dist.group.WORLD, name="w1"),
                ddp_fusion.all_reduce_gradient(g2, dist.group.WORLD, name="w2"))

    gm = make_fx(backward, tracing_mode="fake")(torch.randn(4, 4), torch.randn(6))
    assert graph_stats(gm.graph) == {"collectives": 2, "bytes_reduced": 4 * 22, "fusion_copy_bytes": 0,
                                      "copy_back_bytes": 0, "grads": 0, "grad_copies": 0}
    fuse_ddp_allreduces(gm.graph, algorithm="concat")
    # both gradients made by pointwise kernels: written straight into the bucket
    assert graph_stats(gm.graph) == {"collectives": 1, "bytes_reduced": 4 * 22, "fusion_copy_bytes": 4 * 22,
                                      "copy_back_bytes": 0, "grads": 2, "grad_copies": 0}


def test_graph_stats_count_a_copy_back(fake_pg):
    """A reduced gradient copied into the old ``.grad`` (as ddp_fusion's graphs did before
    the reduced buckets became the ``.grad``s; the pass still does where the reduced
    gradient is read again)."""
    def backward(grad, w1):
        reduced = ddp_fusion.all_reduce_gradient(w1 * 2, dist.group.WORLD, name="w1")
        return grad.copy_(reduced), reduced + 1

    gm = make_fx(backward, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4, 4))
    fuse_ddp_allreduces(gm.graph, algorithm="concat")
    stats = graph_stats(gm.graph)
    assert stats["copy_back_bytes"] == 4 * 16
    assert (stats["grads"], stats["grad_copies"]) == (1, 1)  # the copy back


def test_graph_stats_count_copies_into_kept_grads(fake_pg):
    """A bucket reduced in place in its kept ``.grad``s: no bucket buffer, no copy back;
    a gradient an ``mm`` makes is copied into its ``.grad`` (1), a pointwise one is
    written there (0)."""
    def backward(grad_w, grad_b, x, y):
        return (grad_w.copy_(ddp_fusion.all_reduce_gradient(torch.mm(x, y), dist.group.WORLD, name="w")),
                grad_b.copy_(ddp_fusion.all_reduce_gradient(grad_b + y.sum(0), dist.group.WORLD, name="b")))

    gm = make_fx(backward, tracing_mode="fake")(torch.randn(4, 4), torch.randn(4), torch.randn(4, 4),
                                                torch.randn(4, 4))
    fuse_ddp_allreduces(gm.graph, algorithm="concat")
    assert graph_stats(gm.graph) == {"collectives": 1, "bytes_reduced": 4 * 20, "fusion_copy_bytes": 0,
                                      "copy_back_bytes": 0, "grads": 2, "grad_copies": 1}


def test_first_step_refuses_unknown_models_and_modes_by_name(capsys):
    from bench import first_step

    for argv, named in ((["--model", "mlpp"], "mlpp"), (["--modes", "ddp_optimiser"], "ddp_optimiser"),
                        (["--steps", "0"], "--steps")):
        with pytest.raises(SystemExit) as e:
            first_step.main(argv)
        assert e.value.code == 2
        assert named in capsys.readouterr().err


def test_first_step_table_compares_the_first_steps_with_compute_only_and_splits_phases():
    from bench import first_step

    def rec(times, steps=()):
        return {"times_s": list(times), "compile_phases_s": {}, "steps": list(steps),
                "ready_order_s": 0.25, "pass_s": 0.01}

    # step 1: forward compiles (Dynamo 2 s of which AOT 1.5, Inductor 1), backward 6 s of
    # which Dynamo 4 (AOT 3, Inductor 2); step 2 recompiles the backward (1 s, Dynamo 0.5)
    steps = [{"forward_s": 2.5, "forward_phases_s": {"_compile.compile_inner": 2.0,
                                                     "create_aot_dispatcher_function": 1.5,
                                                     "x.compile_fx_inner": 1.0},
              "backward_s": 6.0, "backward_phases_s": {"_compile.compile_inner": 4.0,
                                                       "create_aot_dispatcher_function": 3.0,
                                                       "compile_fx_inner": 2.0}},
             {"forward_s": 0.1, "forward_phases_s": {},
              "backward_s": 1.0, "backward_phases_s": {"_compile.compile_inner": 0.5}}]
    results = {"mlp": {"ddp_fusion_stock": {"cold": rec([20.0, 4.0, 0.1], steps),
                                            "warm": rec([8.0, 1.0, 0.1])},
                       "compute_only": {"cold": rec([10.0, 0.1, 0.1]), "warm": rec([2.0, 0.1, 0.1])},
                       "ddp_optimizer": {"error": "boom"}}}
    lines = [line for line in first_step.table(results, 3, "none") if line.startswith("| ")]
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in lines}
    assert "| 24.1 | 2.36x | 20.0 | 0.50 | 1.50 | 2.50 | 1.50 | 3.00 | 3.00 | 0.25 | 0.01 |" in \
        rows["ddp_fusion_stock", "cold"], rows
    assert "| 9.1 | 4.14x | 8.0 |" in rows["ddp_fusion_stock", "warm"]
    assert "| 10.2 | 1.00x |" in rows["compute_only", "cold"]
    assert "failed: boom" in rows["ddp_optimizer", "failed: boom"]


def test_host_cost_sorts_wrapper_lines_and_refuses_unknown_modes(capsys):
    from bench import host_cost

    kinds = [host_cost._kind(line) for line in (
        "        del buf3",
        "        buf21 = reinterpret_tensor(buf27, (16, ), (1, ), 0)  # alias",
        "        return (reinterpret_tensor(buf27, (16, 16), (16, 1), 288), )",
        "        buf6 = empty_strided_cpu((16, 16), (16, 1), torch.float32)",
        "        assert_size_stride(arg5_1, (8, 16), (16, 1), 'input')",
        "        extern_kernels.mm(buf5, arg3_1, out=buf10)",
        "        cpp_fused_1(buf5, buf3, buf8, buf21)",
        "        torch.ops.ddp_fusion.all_reduce_bucket.default(buf27, '0')",
    )]
    assert kinds == ["del", "alias of a bucket slice", "return (outputs, views)", "empty_strided",
                     "assert_size_stride/alignment", "extern kernel (mm, ...)", "generated kernel",
                     "ddp_fusion op: all_reduce_bucket"]
    with pytest.raises(SystemExit):
        host_cost.main(["--modes", "ddp_fusion,floor"])
    assert "floor" in capsys.readouterr().err
    result = {"params": 4, "step_ms": 2.0, "guard_us": {"forward": 10.0, "backward": 30.0},
              "wrapper_ms": {"del": [0.5, 20.0]}}
    floor = {**result, "mode": "compiled_autograd", "step_ms": 1.0,
             "guard_us": {"forward": 10.0, "backward": 10.0}, "wrapper_ms": {"del": [0.1, 8.0]}}
    text = host_cost.table([{**result, "mode": "ddp_fusion"}, floor])
    assert "| step, ms (median of round medians) | 2.000 | 1.000 | 250.00 µs |" in text
    assert "| guards of the backward frame, µs per step | 30.000 | 10.000 | 5.00 µs |" in text
    assert "backward wrapper: del, ms (20 / 8 per step) | 0.500 | 0.100 | 100.00 µs |" in text


def test_host_cost_times_a_baseline_checkout_in_the_same_rounds(capsys, tmp_path):
    """``--baseline PATH``: a third column, ddp_fusion from another checkout, after the
    floor's; each other mode's per-round ratio and difference to the first; a path
    without ddp_fusion is refused."""
    from bench import host_cost

    with pytest.raises(SystemExit):
        host_cost.main(["--baseline", str(tmp_path)])
    assert "no ddp_fusion package" in capsys.readouterr().err
    lines = host_cost.ratio_lines({"ddp_fusion": [9.0, 10.0, 12.0], "compiled_autograd": [6.0, 5.0, 6.0],
                                   host_cost.BASELINE: [10.0, 9.0, 13.0]})
    assert lines.splitlines() == [
        "  ddp_fusion / compiled_autograd per round: median 2.000 (1.500-2.000); difference +5.00 ms, "
        "ddp_fusion ahead in 0 of 3",
        "  ddp_fusion / ddp_fusion@baseline per round: median 0.923 (0.900-1.111); difference -1.00 ms, "
        "ddp_fusion ahead in 2 of 3",
    ]
    result = {"params": 4, "step_ms": 2.0, "guard_us": {"forward": 10.0, "backward": 30.0},
              "wrapper_ms": None}
    text = host_cost.table([{**result, "mode": "ddp_fusion"},
                            {**result, "mode": host_cost.BASELINE, "step_ms": 3.0},
                            {**result, "mode": "compiled_autograd", "step_ms": 1.0}])
    assert text.splitlines()[0] == (
        "| | ddp_fusion | compiled_autograd | ddp_fusion@baseline | difference per parameter |")
    assert "| step, ms (median of round medians) | 2.000 | 1.000 | 3.000 | 250.00 µs |" in text


def test_step_time_reports_host_cpu_per_step_against_the_modes_own_floor():
    from bench._lib import jobs, report

    class Ranks:  # a job whose two ranks return these per-step records
        def __init__(self, mode, cpu, main):
            self.key = self.label = mode
            self.failed = None
            self.rec = {"model": "mlp_host", "mode": mode, "cap": None, "times_ms": [],
                        "round_medians_ms": [], "recompiles_during_timing": []}
            self.res = [{"times_ms": [5.0, 7.0], "cpu_ms": c, "main_cpu_ms": m, "recompiles": {"g": 0}}
                        for c, m in zip(cpu, main)]

        def run(self, fn, steps):
            return self.res

    fusion = Ranks("ddp_fusion_concat", cpu=[[4.0, 6.0], [6.0, 8.0]], main=[[3.0, 3.0], [3.0, 5.0]])
    floor = Ranks("compute_compiled_autograd", cpu=[[2.0, 2.0], [2.0, 2.0]], main=[[2.0, 2.0], [2.0, 2.0]])
    jobs.time_round_robin([fusion, floor], rounds=1, steps=2, log=lambda msg: None)
    assert fusion.rec["cpu_ms"] == [5.0, 7.0]  # per step: the mean over ranks
    recs = jobs.records([fusion, floor])
    assert recs["ddp_fusion_concat"]["cpu_ms_median"] == 6.0
    assert recs["ddp_fusion_concat"]["main_cpu_ms_median"] == 3.5
    table = report.cpu_table("mlp_host", recs, None)
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[2:]}
    assert rows["ddp_fusion_concat"] == ["6.00", "3.50", "2.50", "4.00"]  # all, main, other, over floor
    assert rows["compute_compiled_autograd"] == ["2.00", "2.00", "0.00", "-"]


def test_host_probe_times_fixed_work_and_reports_its_spread(capsys):
    from bench import host_probe

    host_probe.main(["--seconds", "0.3"])
    out = capsys.readouterr().out
    for kind in ("python ms", "cpu ops ms"):
        line = next(ln for ln in out.splitlines() if ln.startswith(f"{kind}: n "))
        n = int(line.split(": n ")[1].split()[0])
        assert n >= 2, line  # timed again and again (statistics.quantiles needs two)
        assert f"{kind} in order (every 5th): " in out
    assert "steal ticks" in out


def test_step_time_flags_a_compiled_mode_that_compiled_nothing():
    """Issue 60: ``torch.compile`` of torch DDP around an ``nn.Sequential`` compiles
    nothing on torch 2.13 (Dynamo breaks in DDP's forward and skips torch's own
    modules): such a job must not pass for a compiled one in the table."""
    from bench._lib import report

    def job(mode, graphs):
        return {"model": "mlp_host", "mode": mode, "cap": None, "median_ms": 5.0, "p10_ms": 4.0,
                "p90_ms": 6.0, "min_ms": 4.0, "max_ms": 6.0, "recompiles_during_timing": [],
                "counters": [{"ddp_fusion": {}, "stats": {"unique_graphs": g}} for g in graphs]}

    jobs = {"a": job("ddp_optimizer", [0, 0]), "b": job("ddp_fusion_concat", [2, 2]),
            "c": job("eager_ddp", [0, 0])}
    table, _ = report.step_table("mlp_host", jobs, None)
    lines = {line.split()[0]: line for line in table.splitlines()[2:]}
    assert "compiled nothing" in lines["ddp_optimizer"]
    assert "compiled nothing" not in lines["ddp_fusion_concat"]
    assert "compiled nothing" not in lines["eager_ddp"]  # not a compiled mode


def test_backward_call_counts_statements_and_refuses_a_checkout_without_ddp_fusion(capsys, tmp_path):
    from bench import backward_call

    code = "\n".join([
        "def call(self, args):",
        "    buf0 = empty_strided_cpu((4, ), (1, ), torch.float32)",
        "    buf1 = reinterpret_tensor(buf0, (2, ), (1, ), 0)  # alias",
        "    cpp_fused_0(buf1)",
        "    del buf1",
        "    return (reinterpret_tensor(buf0, (2, ), (1, ), 0), reinterpret_tensor(buf0, (2, ), (1, ), 2), )",
        "",
        "runner = Runner(partitions=[])",
    ])
    n = backward_call.kinds(code)
    assert [n[k] for k in ("empty_strided", "alias of a bucket slice", "generated kernel", "del",
                           "views returned")] == [1, 1, 1, 1, 2]
    with pytest.raises(SystemExit):
        backward_call.main(["--baseline", str(tmp_path)])
    assert "no ddp_fusion package" in capsys.readouterr().err


def test_host_cost_peers_are_each_measured_over_their_own_floor(capsys):
    """``--peers``: DDPOptimizer and eager DDP over ``torch.compile``'s floor, ddp_fusion
    over compiled autograd's, per parameter; a compiled mode that made no graph is
    marked; the wrapper table keeps ddp_fusion's and its floor's columns only."""
    from bench import host_cost

    def r(mode, ms, graphs):
        return {"mode": mode, "params": 4, "step_ms": ms, "dynamo_graphs": graphs,
                "guard_us": {"forward": 1.0, "backward": None}, "wrapper_ms": None}

    results = [r("ddp_fusion", 3.0, 2), r("compiled_autograd", 2.0, 2), r("ddp_optimizer", 4.0, 0),
               r("compiled", 2.5, 1), r("eager_ddp", 5.0, 0)]
    lines = host_cost.over_floor(results).splitlines()
    assert lines[2] == "| ddp_fusion | 3.000 | 2 | compiled_autograd | +1.000 | +250.00 |"
    assert lines[4] == "| ddp_optimizer (compiled nothing) | 4.000 | 0 | compiled | +1.500 | +375.00 |"
    assert lines[6] == "| eager_ddp | 5.000 | 0 | compiled | +2.500 | +625.00 |"
    header, sep = host_cost.table(results).splitlines()[:2]
    assert header.count("|") == sep.count("|") == 5
    hooks = host_cost.over_floor([r("compiled_autograd", 2.0, 2), r(host_cost.HOOKS, 2.5, 2)]).splitlines()
    assert hooks[3] == "| compiled_autograd_hooks | 2.500 | 2 | compiled_autograd | +0.500 | +125.00 |"
    with pytest.raises(SystemExit):
        host_cost.main(["--modes", "ddp_fusion,ddp_optimizr"])
    assert "ddp_optimizr" in capsys.readouterr().err


def test_host_cost_callback_mode_reads_every_gradient_at_the_end_of_the_backward():
    """``compiled_autograd_callback``'s hook on the loss queues one callback that runs
    after every gradient is accumulated (eagerly here: the engine's final callbacks),
    and fails where a parameter got none."""
    from bench import host_cost

    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    loss = (a * 2).sum() + (b * 3).sum()
    loss.register_hook(host_cost._queueing_hook([a, b]))
    loss.backward()
    assert a.grad.tolist() == [2.0, 2.0] and b.grad.tolist() == [3.0, 3.0]
    c = torch.ones(2, requires_grad=True)
    loss = (a * 2).sum()
    loss.register_hook(host_cost._queueing_hook([a, c]))
    with pytest.raises(AssertionError, match="without a gradient"):
        loss.backward()
