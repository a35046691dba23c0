"""Host time of the in-place bucket op of kept ``.grad``s, per step (issue 32).

A bucket whose ``.grad``s exist before the backward is reduced by
``ddp_fusion::all_reduce_in_place`` and waited for by ``ddp_fusion::wait_in_place``
(``ddp_fusion/passes/in_place.py``). Both are ops with Python kernels that take the bucket's
``.grad`` tensors; the first checks from pointers and strides that they are one run of
memory. This times, for N ``.grad`` views of one buffer (1,000 fp32 elements each), on a
fake process group of 2 ranks (no communication), the op and its wait, called as the
compiled graph calls them. Best of 5 repeats of 200 calls, wall time: the host time a
step spends on one bucket of N gradients (the all-reduce itself excluded).

    python -m bench.in_place_cost                       # N = 10, 98, 400
    python -m bench.in_place_cost --sizes 10,1000
"""

from __future__ import annotations

import argparse
import timeit

import torch
import torch.distributed as dist

from bench._lib import _torch


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.in_place_cost",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="10,98,400", help="numbers of .grad tensors in the bucket")
    args = parser.parse_args()
    dist.init_process_group("fake", store=_torch.fake_store(), rank=0, world_size=2)
    import ddp_fusion  # noqa: F401 - registers the ops

    reduce, wait = torch.ops.ddp_fusion.all_reduce_in_place, torch.ops.ddp_fusion.wait_in_place
    group = dist.group.WORLD.group_name
    print(f"torch {torch.__version__}; host time per bucket, best of 5 x 200 calls")
    print(f"{'.grads':>7}{'op + wait us':>14}{'us per .grad':>14}")
    for n in (int(s) for s in args.sizes.split(",")):
        flat = torch.zeros(n * 1000)
        grads = [v.view(10, 100) for v in flat.split(1000)]
        def step(grads: list[torch.Tensor] = grads) -> None:
            reduce(grads, group, "concat")
            wait(grads)

        both = min(timeit.repeat(step, number=200, repeat=5)) / 200
        print(f"{n:>7}{both * 1e6:>14.1f}{both * 1e6 / n:>14.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
