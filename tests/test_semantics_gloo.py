"""Training semantics against eager torch DDP on 2 gloo ranks (4 for ``reduce_dtype``):
the uncompiled bucketed path, unused parameters (uncompiled, and unused on every rank
under torch.compile), gradient accumulation, fp16 / bf16 gradient communication,
``bucket_cap_mb_list``, and bf16 parameters reduced in fp32."""

import pytest

from ddp_fusion import _torch
from ddp_fusion.launch import run_ranks

from _workers import reduce_dtype_bf16, training_semantics


# torch 2.11 and 2.12's CPU code generator fuses a cast to fp16 into the fp32 math after
# it without consulting emulate_precision_casts (2.13 does): a compiled fp16 comm_dtype
# halves fp16-subnormal gradients before it rounds them, once (docs/limits.md)
_ROUNDS_ONCE = _torch.minor_version() in ("2.11", "2.12")


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    dumps = str(tmp_path_factory.mktemp("dumps"))
    return run_ranks(training_semantics, world_size=2, args=(dumps,), timeout=900)


def test_uncompiled_path_matches_eager_ddp_with_one_collective_per_bucket(results):
    for r in results:
        assert r["uncompiled"]["max_diff"] < 1e-6, r
        assert r["uncompiled"]["collectives"] == r["uncompiled"]["buckets"] > 1, r


def test_unused_parameters(results):
    for r in results:
        assert r["unused"]["max_diff"] < 1e-6, r
        assert r["unused"]["c_grad_is_none"]  # used by no rank: like eager DDP
        assert r["unused"]["b_grad_set"]  # used on rank 0 only: averaged everywhere
    # without find_unused_parameters the rank that skipped b says so (and does not hang)
    assert "b.weight" in results[1]["unused_error"]
    assert "find_unused_parameters=True" in results[1]["unused_error"]


def test_no_sync_has_no_communication_and_matches_eager_ddp(results):
    for r in results:
        assert r["no_sync"]["collectives_inside"] == 0
        assert r["no_sync"]["max_diff"] < 1e-6, r


@pytest.mark.parametrize(
    "data, dtype, mode",
    [
        (data, dtype, mode)
        for data in ("normal", "fp16_subnormal")
        for dtype in ("fp16", "bf16")
        for mode in ("uncompiled", "concat", "coalesced")
    ],
)
def test_comm_dtype_reduces_like_torch_compress_hook(results, data, dtype, mode):
    """Reduced gradients with ``comm_dtype`` fp16 / bf16 equal eager torch DDP's with
    ``fp16_compress_hook`` / ``bf16_compress_hook`` bit for bit, and so does no
    ``comm_dtype`` with no hook. The reference is the elementwise cast, halve, sum in
    that dtype, and it differs from fp32 communication in more than 99 % of elements, so
    any other cast or order (or an ignored ``comm_dtype``) fails ``torch.equal``. Data:
    gradients whose halves are fp16 normals, or fp16 subnormals."""
    rounds_once = _ROUNDS_ONCE and (data, dtype) == ("fp16_subnormal", "fp16") and mode != "uncompiled"
    for r in results:
        c = r["comm_dtype"]
        assert c["ref_is_oracle"][data] == {"fp16": True, "bf16": True, "fp32": True}
        assert c["frac_differ_from_fp32"][data][dtype] > 0.99, c["frac_differ_from_fp32"]
        assert c[mode][data]["fp32"]["equal"], c[mode][data]
        if rounds_once:
            # at most one fp16 subnormal step (2**-24) per rank's term, and not equal:
            # when a release of the window rounds twice, this fails and says so
            assert c[mode][data][dtype]["max_diff"] <= 2 * 2.0**-24, c[mode][data]
            assert not c[mode][data][dtype]["equal"], "rounds as torch's hook now: drop _ROUNDS_ONCE"
        else:
            assert c[mode][data][dtype]["equal"], c[mode][data]
    if rounds_once:
        pytest.xfail(
            f"torch {_torch.minor_version()}'s CPU code generator rounds a cast to fp16 "
            "fused into the halving after it once, not twice (docs/limits.md)"
        )


@pytest.mark.parametrize("algorithm", ["concat", "coalesced"])
def test_comm_dtype_compiled_runs_fused(results, algorithm):
    """The compiled comm-dtype runs went through the pass: all 12 gradients (4 per
    dtype) fused, into more buckets than the 3 dtypes (so several keys and
    multi-gradient buckets), none left unfused."""
    for r in results:
        counters = r["comm_dtype"][f"{algorithm}_counters"]
        assert counters["fused_all_reduces"] == 12, counters
        assert 3 < counters["buckets"] < 12, counters
        assert not any(k.startswith("unfused") for k in counters), counters


def test_bucket_cap_mb_list_matches_eager_ddp(results):
    """``bucket_cap_mb_list=[0.01, 0.04, 0.02]`` MiB over eight 16 KiB gradients: torch
    DDP's rebuilt buckets are 16, 48, 32, 32 KiB (each cap in turn, then the last one
    repeats; any single cap gives other sizes). The eager reducer and the compiled plan
    build the same buckets, and parameters after 3 SGD steps match torch DDP's (exactly
    uncompiled; compiled, to 1e-5: summing instead of averaging moves them by 4e-4)."""
    for r in results:
        b = r["bucket_cap_list"]
        assert b["torch_sizes"] == [16384, 49152, 32768, 32768], b
        assert b["eager_sizes"] == b["torch_sizes"], b
        assert b["compiled_sizes"] == b["torch_sizes"], b
        assert b["eager_max_diff"] == 0, b
        assert b["compiled_max_diff"] < 1e-5, b


def test_unused_on_every_rank_under_compile_keeps_grad_none(results):
    """``find_unused_parameters=True``, compiled with fusion on, ``c`` used by no rank:
    its ``.grad`` stays None as in eager torch DDP, the other parameters match torch
    DDP's after 3 SGD steps (to 1e-5: summing instead of averaging moves them by 1e-3),
    and the backward ran fused."""
    for r in results:
        u = r["unused_compiled"]
        assert u["torch_grad_is_none"] == ["c.weight", "c.bias"]
        assert u["grad_is_none"] == u["torch_grad_is_none"], u
        assert u["max_diff"] < 1e-5, u
        assert u["counters"]["fused_all_reduces"] == 4, u
        assert not any(k.startswith("unfused") for k in u["counters"]), u


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(reduce_dtype_bf16, world_size=4, timeout=900)


@pytest.mark.parametrize("mode", ["uncompiled", "concat"])
def test_reduce_dtype_fp32_for_bf16_parameters(four_ranks, mode):
    """bf16 parameters, ``reduce_dtype=torch.float32``, 4 ranks: parameters after 3 SGD
    steps and the last reduced gradients equal eager torch DDP's with
    ``_compress_hook(torch.float32)`` bit for bit; that reference is the exact mean
    rounded once to bf16, and communicating in bf16 instead changes over 10 % of the
    gradients and parameters."""
    for r in four_ranks:
        assert r["ref_is_oracle"]
        assert r["bf16_comm"]["frac_grads_differ"] > 0.1, r["bf16_comm"]
        assert r["bf16_comm"]["frac_params_differ"] > 0.1, r["bf16_comm"]
        assert r[mode]["params_equal"] and r[mode]["grads_equal"], r[mode]
        counters = r["concat"]["counters"]  # the compiled run was fused: 2 buckets
        assert counters["fused_all_reduces"] == 4 and counters["buckets"] == 2, counters
