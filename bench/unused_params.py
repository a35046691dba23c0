"""Collectives and bytes per step with ``find_unused_parameters=True``: eager torch DDP
(its buckets, then a used-parameter bitmap on the device, read on the host) against
ddp_fusion compiled (its buckets; the used parameters agreed on the host group,
ddp_fusion/unused.py).

On 2 gloo ranks, per model and mode, trains 4 SGD steps and profiles the last one
(``torch.profiler``): the model group's collectives (``gloo:*`` events of the main
thread; the host group's point-to-point messages are not collectives of the model's
group) and the bytes of their inputs; for ddp_fusion also how many parameters this
rank's graph lacked in that step. Models: ``moe``, 2 layers
of top-1 mixtures of 8 MLP experts (width 256) with 6 tokens per rank, so that each
rank leaves different experts out; ``mlp``, 8 Linear+LayerNorm layers (width 256), which
uses every parameter (``fused_all_used``: ddp_fusion without ``find_unused_parameters``,
the cost of the flag itself). Counts only, no timing.

    python -m bench.unused_params                  # bucket_cap_mb=0.5
    python -m bench.unused_params --cap-mb 25 --models moe
"""

from __future__ import annotations

import argparse
import json

from bench._lib.record import provenance, write_json
from bench._lib.unused_params import count_step
from ddp_fusion.launch import run_ranks

MODES = {"moe": ("eager", "fused"), "mlp": ("eager", "fused", "fused_all_used")}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.unused_params", description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="moe,mlp")
    parser.add_argument("--cap-mb", type=float, default=0.5, help="bucket_cap_mb of every model")
    args = parser.parse_args()
    out = {"provenance": provenance(), "cap_mb": args.cap_mb, "results": {}}
    print(f"bucket_cap_mb={args.cap_mb}; last of 4 steps, per rank")
    print(f"{'model':<6}{'mode':<16}{'rank':>5}{'collectives':>34}{'bytes':>10}{'absent here':>12}")
    for model in args.models.split(","):
        for mode in MODES[model]:
            ranks = run_ranks(count_step, world_size=2, args=(model, mode, args.cap_mb), timeout=900)
            out["results"][f"{model}/{mode}"] = ranks
            for rank, r in enumerate(ranks):
                print(f"{model:<6}{mode:<16}{rank:>5}{json.dumps(r['collectives']):>34}{r['bytes']:>10}"
                      f"{r['absent_last_step']:>12}")
    print("raw:", write_json("unused_params.json", out))


if __name__ == "__main__":
    main()
