"""One torchft replica group (one process, world size 1) training with torchft's
``DistributedDataParallel`` + ``Manager``, as torchft's own integration test
(``torchft/manager_integ_test.py``, ``ddp_train_loop``) does, optionally compiled with
ddp_fusion on. Run by tests/test_torchft.py:

    python tests/_torchft_replica.py --replica 0 --lighthouse ADDR --steps 6 --out OUT \
        [--compiled] [--kill-at 3]

Each step's data comes from (replica, manager step), so a step retried after a failure
sees the same data. With ``--kill-at S`` the process kills itself (SIGKILL) in the middle
of step S, after the forward. A backward that fails because the manager's all-reduce
failed (the other replica died) is a discarded step (see the HACK below). Writes ``OUT.pt``
(model and optimizer state) and
``OUT.json`` (per attempted step: the manager step, participants, whether it committed,
the bucket all-reduces sent through the manager; ddp_fusion's counters).
"""

import argparse
import json
import os
import signal
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn, optim

import ddp_fusion
from ddp_fusion import _torch


class MyModel(nn.Module):
    """torchft's integration-test model, a little wider (several buckets below)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(3, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4)
        )

    def forward(self, x):
        return self.layers(x)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--replica", type=int, required=True)
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--min-replicas", type=int, default=2)
    parser.add_argument("--compiled", action="store_true")
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from torchft.ddp import DistributedDataParallel
    from torchft.manager import Manager
    from torchft.optim import OptimizerWrapper
    from torchft.process_group import ProcessGroupGloo

    store = dist.TCPStore(host_name="localhost", port=0, is_master=True, wait_for_workers=False)

    def load_state_dict(state):
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optim"])

    def state_dict():
        return {"model": model.state_dict(), "optim": inner.state_dict()}

    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=20)),
        min_replica_size=args.min_replicas,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=str(args.replica),
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=args.lighthouse,
        port=0,
        timeout=timedelta(seconds=20),
        quorum_timeout=timedelta(seconds=300),
        use_async_quorum=False,
    )
    sent = []
    allreduce = manager.allreduce

    def counting_allreduce(tensor, *a, **kw):
        sent.append(tensor.numel())
        return allreduce(tensor, *a, **kw)

    manager.allreduce = counting_allreduce

    torch.manual_seed(42)
    model = MyModel()
    if args.compiled:
        ddp_fusion.config.enabled = True  # before torchft wraps the model in (torch) DDP
    ddp = DistributedDataParallel(manager, model, bucket_cap_mb=0.002)
    run = torch.compile(ddp) if args.compiled else ddp
    inner = optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = OptimizerWrapper(manager, inner)

    log = []
    while manager.current_step() < args.steps:
        optimizer.zero_grad()  # starts the quorum (and heals a recovering replica)
        step = manager.current_step()
        gen = torch.Generator().manual_seed(1000 * args.replica + step)
        x, labels = torch.rand(8, 3, generator=gen), torch.randint(4, (8,), generator=gen)
        loss = nn.functional.cross_entropy(run(x), labels)
        if args.kill_at == step:
            os.kill(os.getpid(), signal.SIGKILL)
        sent.clear()
        try:
            loss.backward()
        except Exception:  # noqa: BLE001
            # HACK: torchft 0.2.0's DDP comm hook asserts (`assert fut._fut`) once the
            # manager's all-reduce has failed, in eager torch DDP as under ddp_fusion;
            # the manager has recorded the error, and should_commit() discards the step.
            if not manager.errored():
                raise
        committed = manager.should_commit()
        if committed:
            inner.step()
        log.append({"step": step, "participants": manager.num_participants(),
                    "committed": committed, "sent": list(sent)})

    torch.save(state_dict(), args.out + ".pt")
    with open(args.out + ".json", "w") as f:
        json.dump({"log": log, "adopted": hasattr(ddp, "_ddp_fusion"),
                   "ddp_fusion": dict(_torch.dynamo.counters()["ddp_fusion"])}, f)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
