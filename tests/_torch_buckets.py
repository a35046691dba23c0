"""torch DDP's own bucket-size rule, as the reference ddp_fusion's (plan.py) is tested
against: the limits torch's C++ reducer uses when it rebuilds buckets after the first
iteration, read from torch's ``_BucketCapacityConfig`` (torch 2.12 and later) or, on
torch 2.11, from the same rule written inline in ``DistributedDataParallel``."""

import torch.distributed as dist
from torch.nn.parallel import distributed as torch_ddp


def torch_rebuild_limits(bucket_cap_mb=None, bucket_cap_mb_list=None) -> list[int]:
    config = getattr(torch_ddp, "_BucketCapacityConfig", None)
    if config is not None:
        cfg = config.create(bucket_cap_mb, bucket_cap_mb_list, use_python_reducer=False)
        _, for_rebuild = cfg.compute_bucket_size_limits(static_graph=False, find_unused_parameters=False)
        return for_rebuild or [cfg.first_bucket_bytes_cap, cfg.bucket_bytes_cap]
    # torch 2.11's DistributedDataParallel.__init__ and _ddp_init_helper
    if bucket_cap_mb_list:
        return [int(mb * 1024 * 1024) for mb in bucket_cap_mb_list]
    cap = int((25 if bucket_cap_mb is None else bucket_cap_mb) * 1024 * 1024)
    first = dist._DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else cap
    return [first, cap]
