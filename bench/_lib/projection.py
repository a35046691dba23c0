"""The GPU projection: DDP gradient communication of a GPT-2-small-sized job on 8-1,024
H100 GPUs, from published link rates and NCCL's latency constants (pure functions).

* :func:`gpt2_small_grads`: GPT-2 small's gradients in ready order, with the fraction
  of backward at which each is ready;
* :func:`ddp_buckets`: DDP's buckets of them (DDP's rule, ``ddp_fusion.plan``);
* :func:`nccl_allreduce_s`: an NCCL-style all-reduce time (ring or tree, whichever is
  faster, as NCCL's tuner picks);
* :func:`project_one`: a step with collectives on one stream overlapping backward;
* :func:`projection`: the tables ``bench.cost_model`` prints.

GPU compute is 6 * N * tokens FLOPs at an assumed MFU: a projection, not a measurement.
"""

from __future__ import annotations

import math
from typing import Any

from ddp_fusion.plan import ddp_bucket_limits, split_by_rule

# Published parameters. Latencies are NCCL's own tuning constants for the Simple protocol
# (the one large gradient buckets use), NCCL 2.20.3, src/graph/tuning.cc (baseLat, hwLat).
PARAMS: dict[str, dict[str, Any]] = {
    "gpus_per_node": {"value": 8, "unit": "GPUs", "source": "DGX H100 user guide: 8x H100 SXM5 per system"},
    "B_nvlink": {"value": 450e9, "unit": "B/s per GPU per direction",
                 "source": "NVIDIA H100 datasheet: NVLink 900 GB/s total bidirectional per "
                           "H100 SXM GPU (NVLink 4); 450 GB/s each way. Peak, not achieved."},
    "B_ib": {"value": 50e9, "unit": "B/s per GPU per direction",
             "source": "DGX H100 user guide: 8x ConnectX-7, 400 Gb/s InfiniBand NDR each, one per "
                       "GPU: 400 Gb/s = 50 GB/s. Peak, not achieved."},
    "ring_base_lat": {"value": 8.4e-6, "unit": "s per all-reduce",
                      "source": "NCCL 2.20.3 src/graph/tuning.cc baseLat[Ring][Simple]"},
    "ring_nvlink_lat": {"value": 3.4e-6, "unit": "s per ring step",
                        "source": "NCCL 2.20.3 tuning.cc hwLat[NVLink][Ring][Simple]"},
    "ring_net_lat": {"value": 14.0e-6, "unit": "s per inter-node ring step",
                     "source": "NCCL 2.20.3 tuning.cc hwLat[Net][Ring][Simple] (+ latencyInter, "
                               "topology-dependent, taken as 0)"},
    "tree_base_lat": {"value": 0.0, "unit": "s per all-reduce",
                      "source": "NCCL 2.20.3 tuning.cc baseLat[Tree][Simple]"},
    "tree_nvlink_lat": {"value": 28e-6, "unit": "s per tree hop",
                        "source": "NCCL 2.20.3 tuning.cc hwLat[NVLink][Tree][Simple]"},
    "tree_net_lat": {"value": 28e-6, "unit": "s per tree level",
                     "source": "NCCL 2.20.3 tuning.cc hwLat[Net][Tree][Simple]"},
    "ring_ll_base_lat": {"value": 6.6e-6, "unit": "s per collective",
                         "source": "NCCL tuning.cc (the same table) baseLat[Ring][LL]: the "
                                   "protocol of tiny messages"},
    "ring_ll_nvlink_lat": {"value": 0.6e-6, "unit": "s per ring step",
                           "source": "NCCL tuning.cc hwLat[NVLink][Ring][LL]"},
    "ring_ll_net_lat": {"value": 2.7e-6, "unit": "s per inter-node ring step",
                        "source": "NCCL tuning.cc hwLat[Net][Ring][LL]"},
    "net_overhead": {"value": 1.0e-6, "unit": "s per ring step, with several nodes",
                     "source": "NCCL tuning.cc getNetOverhead (x86 Intel; AMD 2 us): the floor "
                               "of an intra-node step once a ring spans nodes"},
    "peak_bf16": {"value": 989e12, "unit": "FLOP/s",
                  "source": "NVIDIA H100 datasheet: H100 SXM BF16 Tensor Core 1,979 TFLOPS with "
                            "sparsity, i.e. 989 dense"},
    "hbm_bw": {"value": 3.35e12, "unit": "B/s",
               "source": "NVIDIA H100 datasheet: H100 SXM 3.35 TB/s HBM3"},
    "host_round": {"value": 60e-6, "unit": "s per round of a host-side exchange",
                   "source": "ASSUMPTION: one gloo TCP message between two hosts plus ddp_fusion's "
                             "Python per round (this machine's loopback measures the Python and "
                             "gloo part: bench/results/plan_check_scale_cpu_2026-11-25.md); "
                             "sensitivity shown"},
    "mfu": {"value": 0.40, "unit": "fraction of peak_bf16",
            "source": "ASSUMPTION (typical well-tuned GPT training; sensitivity shown)"},
    "tokens_per_gpu": {"value": 8 * 1024, "unit": "tokens per step per GPU",
                       "source": "ASSUMPTION: micro-batch 8 x sequence 1024, no accumulation"},
}
GPU_COUNTS = (8, 16, 64, 256, 1024)
BUCKET_LIMITS = tuple(ddp_bucket_limits())  # torch DDP's default: 1 MiB first bucket, then 25 MiB

Grad = tuple[str, int, float]  # (name, numel, ready fraction of backward)
Msg = tuple[int, float]  # (bytes, ready fraction of backward)


def values() -> dict[str, float]:
    """:data:`PARAMS`' values by name."""
    return {k: v["value"] for k, v in PARAMS.items()}


def gpt2_small_grads() -> list[Grad]:
    """``(name, numel, ready fraction of backward)`` in gradient-ready order for GPT-2 small
    (vocab 50257, context 1024, d 768, 12 layers, LM head tied to the token embedding).

    Backward FLOPs of a tensor = 4 * numel * tokens (the backward 2/3 of 6 * N * tokens;
    attention-score FLOPs are ignored); layers run in reverse. The tied head's matmul
    backward runs first, but the shared weight's gradient is complete (ready) only after
    the embedding backward at the very end."""
    v, ctx, d, layers = 50257, 1024, 768, 12
    order: list[tuple[str, int, bool]] = [("head(wte)", v * d, False), ("ln_f.weight", d, True),
                                          ("ln_f.bias", d, True)]
    for i in reversed(range(layers)):
        p = f"h.{i}."
        order += [(p + "mlp.c_proj.weight", 4 * d * d, True), (p + "mlp.c_proj.bias", d, True),
                  (p + "mlp.c_fc.weight", 4 * d * d, True), (p + "mlp.c_fc.bias", 4 * d, True),
                  (p + "ln_2.weight", d, True), (p + "ln_2.bias", d, True),
                  (p + "attn.c_proj.weight", d * d, True), (p + "attn.c_proj.bias", d, True),
                  (p + "attn.c_attn.weight", 3 * d * d, True), (p + "attn.c_attn.bias", 3 * d, True),
                  (p + "ln_1.weight", d, True), (p + "ln_1.bias", d, True)]
    order += [("wpe", ctx * d, True), ("wte", 0, True)]
    total = sum(n for _, n, _ in order)
    out, cum = [], 0
    for name, n, is_grad in order:
        cum += n
        if is_grad:
            out.append((name, v * d if name == "wte" else n, cum / total))
    return out


def ddp_buckets(grads: list[Grad], limits: tuple[int, ...] = BUCKET_LIMITS) -> list[Msg]:
    """``(bytes, ready fraction)`` per bucket: fp32 gradients in ready order under DDP's
    rule (a bucket closes once it reaches the current limit; the last limit repeats); a
    bucket is ready when its last gradient is."""
    buckets = split_by_rule(grads, lambda g: 4 * g[1], limits)
    return [(sum(4 * n for _, n, _ in b), b[-1][2]) for b in buckets]


def nccl_allreduce_s(nbytes: float, p: int, prm: dict[str, float], lat_scale: float = 1.0,
                     bw_scale: float = 1.0) -> tuple[float, str]:
    """Modelled NCCL all-reduce time (s) and the algorithm (ring or tree, whichever is
    faster). Bandwidth term 2(p-1)/p * n / B with B the slowest link (NVLink inside a
    node, the NIC once p > 8) for both; latency terms as NCCL's tuning.cc: ring base +
    (2(p-1) - 2N) intra steps + 2N inter steps, tree 2((ppn-1) intra + log2(N) inter),
    N nodes (inter terms only when N > 1)."""
    if p <= 1:
        return 0.0, "-"
    g = prm["gpus_per_node"]
    nodes = max(1, math.ceil(p / g))
    ppn = min(p, g)
    b = (prm["B_nvlink"] if nodes == 1 else prm["B_ib"]) * bw_scale
    bw = 2 * (p - 1) / p * nbytes / b
    inter = 2 * nodes if nodes > 1 else 0
    ring = prm["ring_base_lat"] + (2 * (p - 1) - inter) * prm["ring_nvlink_lat"] + inter * prm["ring_net_lat"]
    tree = prm["tree_base_lat"] + 2 * ((ppn - 1) * prm["tree_nvlink_lat"] +
                                       math.log2(nodes) * prm["tree_net_lat"])
    ring, tree = ring * lat_scale, tree * lat_scale
    return (ring + bw, "ring") if ring <= tree else (tree + bw, "tree")


def nccl_allgather_latency_s(p: int, prm: dict[str, float]) -> float:
    """The latency of NCCL's ring all-gather of a tiny message (what the old per-step plan
    check issued: one int64 per rank; the LL protocol), as NCCL's tuning.cc counts it:
    base + (p - 1) steps, ``nodes - 1`` of them inter-node, the others at least the
    network overhead once the ring spans nodes. There is no tree for all-gather."""
    if p <= 1:
        return 0.0
    nodes = max(1, math.ceil(p / prm["gpus_per_node"]))
    intra = prm["ring_ll_nvlink_lat"] if nodes == 1 else max(prm["ring_ll_nvlink_lat"], prm["net_overhead"])
    inter = nodes - 1
    return prm["ring_ll_base_lat"] + (p - 1 - inter) * intra + inter * prm["ring_ll_net_lat"]


def host_exchange_rounds(p: int) -> int:
    """Rounds of the host group's max (host_group.py: recursive doubling, the ranks above
    the largest power of two folded in first and out last)."""
    if p <= 1:
        return 0
    low = 1 << (p.bit_length() - 1)
    return (low.bit_length() - 1) + (0 if low == p else 2)


PLAN_CHECK_GPUS = (8, 64, 512, 1024, 4096, 8192)


def plan_check_costs(prm: dict[str, float] | None = None, gpus: tuple[int, ...] = PLAN_CHECK_GPUS,
                     host_round: float | None = None) -> list[dict[str, Any]]:
    """Per GPU count, the per-step fixed costs (ms): ddp_fusion's plan check before
    (NCCL ring all-gather of one int64 per rank, read on the host: a device sync) and
    now (the host group's max: ``rounds * host_round``, on its own thread, no device
    involved), beside eager DDP's own per-step fixed cost (the latency of its bucket
    all-reduces on GPT-2 small at DDP's default caps), and the backward time before
    the first bucket is issued, which hides the new check."""
    prm = prm or values()
    host_round = prm["host_round"] if host_round is None else host_round
    grads = gpt2_small_grads()
    buckets = ddp_buckets(grads)
    compute = 6 * sum(n for _, n, _ in grads) * prm["tokens_per_gpu"] / (prm["mfu"] * prm["peak_bf16"])
    first_bucket_s = buckets[0][1] * 2 * compute / 3
    rows = []
    for p in gpus:
        rounds = host_exchange_rounds(p)
        rows.append({
            "gpus": p,
            "old_allgather_ms": 1e3 * nccl_allgather_latency_s(p, prm),
            "new_rounds": rounds,
            "new_ms": 1e3 * rounds * host_round,
            "eager_ddp_fixed_ms": 1e3 * len(buckets) * nccl_allreduce_s(0, p, prm)[0],
            "buckets": len(buckets),
            "first_bucket_ms": 1e3 * first_bucket_s,
        })
    return rows


def project_one(msgs: list[Msg], p: int, prm: dict[str, float], fwd: float, bwd: float,
                opt: float, blocking: bool = False, **scale: float) -> dict[str, Any]:
    """A step on ``p`` GPUs (times in s in, ms out): collectives ``(bytes, ready fraction
    of backward)`` in order on one stream, waits at the end of backward (``blocking``:
    each collective is waited for at once, stalling compute). ``scale``: ``lat_scale``,
    ``bw_scale`` of :func:`nccl_allreduce_s`."""
    end, algos, total, stall = 0.0, set(), 0.0, 0.0
    for nbytes, frac in msgs:
        d, algo = nccl_allreduce_s(nbytes, p, prm, **scale)
        algos.add(algo)
        total += d
        if blocking:
            stall += d
        else:
            end = max(end, frac * bwd) + d
    exposed = stall if blocking else max(0.0, end - bwd)
    return {"step_ms": 1e3 * (fwd + bwd + exposed + opt), "exposed_ms": 1e3 * exposed,
            "comm_ms": 1e3 * total, "overlap_pct": 100 * (1 - exposed / total) if total else 100.0,
            "algo": "/".join(sorted(algos))}


UNFUSED = "unfused (1 all-reduce per gradient)"
BUCKETS = "DDP buckets (eager DDP = ddp_fusion)"
ONE = "one bucket at the end"


def projection(mfu: float | None = None) -> dict[str, Any]:
    """Every table of the projection: per GPU count, for one all-reduce per gradient,
    DDP buckets and one bucket at the end; sensitivity to latency, bandwidth, MFU and
    bucket cap."""
    prm = values()
    if mfu is not None:
        prm["mfu"] = mfu
    grads = gpt2_small_grads()
    n_params = sum(n for _, n, _ in grads)
    flops = 6 * n_params * prm["tokens_per_gpu"]
    compute = flops / (prm["mfu"] * prm["peak_bf16"])
    fwd, bwd = compute / 3, 2 * compute / 3
    opt = 12 * n_params / prm["hbm_bw"]  # SGD as in the benchmark: read p, g; write p (fp32)
    variants = {UNFUSED: [(4 * n, r) for _, n, r in grads], BUCKETS: ddp_buckets(grads),
                ONE: [(4 * n_params, 1.0)]}
    tables: dict[str, Any] = {name: {p: project_one(msgs, p, prm, fwd, bwd, opt) for p in GPU_COUNTS}
                              for name, msgs in variants.items()}
    tables["unfused, each wait right after its all-reduce"] = {
        p: project_one(variants[UNFUSED], p, prm, fwd, bwd, opt, blocking=True) for p in GPU_COUNTS}
    sens = []
    for label, kw in (("latency x0.5", {"lat_scale": 0.5}), ("latency x1", {}),
                      ("latency x2", {"lat_scale": 2.0}), ("latency x4", {"lat_scale": 4.0}),
                      ("bandwidth x0.7 (achieved vs peak)", {"bw_scale": 0.7})):
        for p in (16, 1024):
            sens.append({"case": label, "gpus": p, **{
                name: project_one(msgs, p, prm, fwd, bwd, opt, **kw) for name, msgs in variants.items()}})
    mfu_sens = []
    for m in (0.2, 0.4, 0.6):
        c = flops / (m * prm["peak_bf16"])
        for p in (16, 1024):
            mfu_sens.append({"mfu": m, "gpus": p, "compute_ms": 1e3 * c, **{
                name: project_one(msgs, p, prm, c / 3, 2 * c / 3, opt) for name, msgs in variants.items()}})
    cap_sens = []
    for cap_mib in (5, 25, 100, 250):
        limits = ddp_bucket_limits(bucket_cap_mb_list=[BUCKET_LIMITS[0] / 2**20, cap_mib])
        msgs = ddp_buckets(grads, tuple(limits))
        for p in (16, 1024):
            cap_sens.append({"cap_mib": cap_mib, "gpus": p, "buckets": len(msgs),
                             **project_one(msgs, p, prm, fwd, bwd, opt)})
    return {
        "config": {"model": "GPT-2 small (vocab 50257, ctx 1024, d 768, 12 layers, tied head)",
                   "params": n_params, "grad_bytes": 4 * n_params, "tensors": len(grads),
                   "flops_per_step": flops, "forward_ms": 1e3 * fwd, "backward_ms": 1e3 * bwd,
                   "optimizer_ms": 1e3 * opt,
                   "buckets": [{"bytes": b, "ready_frac": r} for b, r in variants[BUCKETS]],
                   "bucket_caps": list(BUCKET_LIMITS)},
        "params": PARAMS, "tables": {k: {str(p): v for p, v in t.items()} for k, t in tables.items()},
        "latency_bandwidth_sensitivity": sens, "mfu_sensitivity": mfu_sens,
        "bucket_cap_sensitivity": cap_sens,
        "plan_check": plan_check_costs(prm),
        "plan_check_host_round_x4": plan_check_costs(prm, host_round=4 * prm["host_round"]),
        "allreduce_examples": [
            {"gpus": p, "bytes": n, "ms": 1e3 * nccl_allreduce_s(n, p, prm)[0],
             "algo": nccl_allreduce_s(n, p, prm)[1]}
            for p in GPU_COUNTS for n in (4 * 768, 25 << 20, 4 * n_params)],
    }
