"""torch DDP on every GPU of several nodes, launched by torchrun, compiled, with
ddp_fusion's one line. The same script runs on one node, and on CPU ranks (gloo).

Run the same command on each of the N nodes; the c10d rendezvous numbers the nodes
(``--node-rank`` is not needed) and hosts its store at the endpoint, any node's address:

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint node0.example.com:29500 --rdzv-id job42 examples/multinode_torchrun.py

Under SLURM, one torchrun per node, started by srun (in the batch script):

    head=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
    srun --ntasks-per-node 1 torchrun --nnodes "$SLURM_NNODES" --nproc-per-node 8 \\
        --rdzv-backend c10d --rdzv-endpoint "$head:29500" --rdzv-id "$SLURM_JOB_ID" \\
        examples/multinode_torchrun.py

torchrun gives each process RANK (0 .. WORLD_SIZE-1, unique in the job), LOCAL_RANK
(0 .. LOCAL_WORLD_SIZE-1, unique on its node), WORLD_SIZE and LOCAL_WORLD_SIZE. The
GPU is picked by LOCAL_RANK; the data shard and anything named per process (files,
logs) by RANK. On CPU (``--device cpu``, gloo) two torchrun agents on one machine make
a two-"node" job, as tests/test_multinode.py runs it.
"""

import os

import torch
import torch.distributed as dist

import ddp_fusion
from _common import BUCKET_CAP_MB, count_all_reduces, dataset, finish, model, parse_args

BATCH = 8


def main() -> None:
    args = parse_args(__doc__, extra=lambda p: p.add_argument(
        "--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda: one GPU per process (LOCAL_RANK), NCCL; cpu: gloo"))
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        device = torch.device("cuda", local_rank)
        # Before the process group: NCCL, and the object collectives torch and ddp_fusion
        # run at start-up, use the current device; left at cuda:0, every process of the
        # node would use GPU 0.
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    if args.mode == "fused":
        ddp_fusion.config.enabled = True  # the one line: before wrapping
    ddp = torch.nn.parallel.DistributedDataParallel(
        model().to(device),
        device_ids=[local_rank] if device.type == "cuda" else None,
        bucket_cap_mb=BUCKET_CAP_MB,
    )
    net = torch.compile(ddp) if args.mode == "fused" else ddp
    opt = torch.optim.AdamW(net.parameters(), lr=1e-3)

    # The sampler shards by the global rank and world size (dist.get_rank(), RANK), never
    # by LOCAL_RANK, which repeats on every node.
    data = dataset(args.steps, BATCH, ranks=dist.get_world_size())
    sampler = torch.utils.data.distributed.DistributedSampler(data, shuffle=False)
    batches = [x.to(device) for (x,) in torch.utils.data.DataLoader(data, BATCH, sampler=sampler)]

    def step(x):
        opt.zero_grad()
        net(x).square().mean().backward()
        opt.step()

    for x in batches[:-1]:
        step(x)
    finish(args, ddp, count_all_reduces(lambda: step(batches[-1])))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
