"""Compiled backward graphs follow the forward's shapes policy (a fresh interpreter,
fake group of 2): while the forward is compiled for static shapes, compiled autograd
traces backward with static sizes (faster code than dynamic kernels); once Dynamo
recompiles the forward with dynamic shapes (a shape changed: its automatic dynamic),
backward is traced dynamic too, so a run with varying sequence lengths compiles a
bounded number of graphs, not one per length."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import json, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch._dynamo.utils import counters
import ddp_fusion
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
ddp_fusion.config.enabled = True

class Tiny(torch.nn.Module):  # token ids -> logits: the sequence length varies
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.lin = torch.nn.Linear(16, 16)
        self.out = torch.nn.Linear(16, 50)
    def forward(self, ids):
        return self.out(torch.relu(self.lin(self.emb(ids))))

torch.manual_seed(0)
model = torch.compile(ddp_fusion.DistributedDataParallel(Tiny()))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
def dynamic():  # the flag compiled autograd traces with now
    current = torch._C._dynamo.compiled_autograd.set_autograd_compiler(None, False)
    torch._C._dynamo.compiled_autograd.set_autograd_compiler(*current)
    return current[1]
def step(seq):
    opt.zero_grad()
    model(torch.randint(0, 50, (4, seq))).square().mean().backward()
    opt.step()
for _ in range(3):
    step(8)
stable = {"dynamic": dynamic(),
          "captures": counters["compiled_autograd"]["captures"]}
for seq in (9, 11, 13, 17, 23, 31, 40):
    step(seq)
varying = {"dynamic": dynamic(),
           "captures": counters["compiled_autograd"]["captures"],
           "forward_compiles": counters["stats"]["unique_graphs"],
           "plans": counters["ddp_fusion"]["plans_run"],
           "fused_graphs": counters["ddp_fusion"]["graphs"],
           "unfused": counters["ddp_fusion"]["unfused"]}
print(json.dumps({"stable": stable, "varying": varying}))
"""


def test_static_backward_while_shapes_are_stable_dynamic_after_they_change(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DDP_FUSION")}
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600,
                         env={**env, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout.splitlines()[-1])
    assert r["stable"] == {"dynamic": False, "captures": 1}, r
    # 7 new lengths: the forward recompiles once, dynamic; backward likewise (one
    # static capture for the first new length at most, then one dynamic graph)
    assert r["varying"]["dynamic"] is True, r
    assert r["varying"]["captures"] <= 3, r
    assert r["varying"]["plans"] == 1, r  # every graph has the same bucket plan
    # and every backward graph, the dynamic one included, was fused: no gradient left out
    assert r["varying"]["fused_graphs"] == r["varying"]["captures"], r
    assert r["varying"]["unfused"] == 0, r
