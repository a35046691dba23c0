"""The flag as users of HF Trainer, Lightning and Accelerate set it: ``DDP_FUSION=1`` in
the environment of a script that never imports ddp_fusion (torch loads it through its
``torch.backends`` entry point); ``TORCH_LOGS`` knows ddp_fusion's names; and nothing is
compiled that the user did not compile. Each case is a fresh interpreter (compiled
autograd, once a model has run compiled, stays on for the process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PRELUDE = """
import json, logging, sys, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch._dynamo.utils import counters
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
warnings = []
class Keep(logging.Handler):
    def emit(self, record): warnings.append(record.getMessage())
logging.getLogger("ddp_fusion").addHandler(Keep(level=logging.WARNING))
def net():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
def steps(model, n):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(n):
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
"""

# DDP_FUSION=1, and the script never names ddp_fusion: a torch DDP is adopted; trained
# uncompiled it compiles nothing; compiled, it is fused.
STOCK = PRELUDE + """
loaded = "ddp_fusion" in sys.modules
ddp = torch.nn.parallel.DistributedDataParallel(net())
adopted = hasattr(ddp, "_ddp_fusion")
steps(ddp, 2)
eager = {"captures": counters["compiled_autograd"]["captures"],
         "plans": counters["ddp_fusion"]["plans_run"]}
steps(torch.compile(ddp), 2)
compiled = {"captures": counters["compiled_autograd"]["captures"],
            "plans": counters["ddp_fusion"]["plans_run"]}
print(json.dumps({"loaded": loaded, "adopted": adopted, "eager": eager, "compiled": compiled,
                  "warnings": warnings}))
"""

# The flag turned on after the model's first compiled step.
LATE = PRELUDE + """
import ddp_fusion
model = torch.compile(ddp_fusion.DistributedDataParallel(net()))
steps(model, 1)
ddp_fusion.config.enabled = True
steps(model, 2)
print(json.dumps({"warnings": warnings, "plans": counters["ddp_fusion"]["plans_run"]}))
"""

# The flag on, a model compiled, but no data-parallel model in the process.
NO_DDP = PRELUDE + """
import ddp_fusion
ddp_fusion.config.enabled = True
steps(torch.compile(net()), 1)
print(json.dumps({"warnings": warnings}))
"""

# TORCH_LOGS=ddp_fusion shows the adoption line (INFO).
INFO = PRELUDE + """
torch.nn.parallel.DistributedDataParallel(net())
"""

# Without DDP_FUSION: torch loads ddp_fusion through the entry point, cheaply.
CHEAP = """
import json, sys, torch
print(json.dumps({"loaded": "ddp_fusion" in sys.modules, "dynamo": "torch._dynamo" in sys.modules,
                  "enabled": sys.modules["ddp_fusion"].config.enabled}))
"""


def _run(script: str, cache: str, **env: str) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("DDP_FUSION", "TORCH_LOGS"))}
    base["TORCHINDUCTOR_CACHE_DIR"] = cache  # a cold cache: the pass runs
    return subprocess.Popen([sys.executable, "-c", script], env={**base, **env}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    def run(name, script, **env):
        return _run(script, str(tmp_path_factory.mktemp(name)), **env)

    procs = {
        "stock": run("stock", STOCK, DDP_FUSION="1"),
        "info": run("info", INFO, DDP_FUSION="1", TORCH_LOGS="ddp_fusion"),
        "late": run("late", LATE),
        "no_ddp": run("no_ddp", NO_DDP),
        "cheap": run("cheap", CHEAP),
        "help": run("help", "import torch", TORCH_LOGS="help"),
    }
    out = {}
    for name, p in procs.items():
        stdout, stderr = p.communicate(timeout=600)
        out[name] = (p.returncode, stdout, stderr)
    return out


def _result(runs, name):
    code, stdout, stderr = runs[name]
    assert code == 0, stderr
    return json.loads(stdout.strip().splitlines()[-1]), stderr


def test_env_flag_works_in_a_script_that_never_imports_ddp_fusion(runs):
    r, stderr = _result(runs, "stock")
    assert r["loaded"] and r["adopted"], r
    assert r["compiled"]["captures"] > 0 and r["compiled"]["plans"] == 1, r


def test_uncompiled_model_under_the_flag_compiles_nothing(runs):
    """Eager DDP's speed: the eager bucketed reducer, no compiled-autograd capture."""
    r, _ = _result(runs, "stock")
    assert r["eager"] == {"captures": 0, "plans": 0}, r
    assert r["warnings"] == [], r


def test_adoption_is_logged_at_info_under_torch_logs(runs):
    code, _, stderr = runs["info"]
    assert code == 0, stderr
    assert "ddp_fusion: torch.nn.parallel.DistributedDataParallel (ddp_fusion) reduces 4 parameters" in stderr
    assert "bucket caps [1.0, 25.0] MiB; algorithm concat" in stderr


def test_flag_turned_on_after_compiling_names_the_cause_and_the_fix(runs):
    r, _ = _result(runs, "late")
    assert r["plans"] == 0
    (warning,) = r["warnings"]
    assert "config.enabled was turned on after this model's forward was compiled" in warning
    assert "before the first torch.compile call, or call torch._dynamo.reset()" in warning


def test_flag_on_with_no_data_parallel_model_says_so(runs):
    r, _ = _result(runs, "no_ddp")
    assert any("no data-parallel model was wrapped or adopted in this process" in w for w in r["warnings"])


def test_without_the_flag_the_entry_point_is_cheap(runs):
    r, _ = _result(runs, "cheap")
    assert r == {"loaded": True, "dynamo": False, "enabled": False}


def test_torch_logs_help_lists_ddp_fusion(runs):
    code, _, stderr = runs["help"]
    assert code != 0  # torch answers TORCH_LOGS=help with the list, as an error
    lines = stderr.splitlines()
    assert any(line.strip() == "ddp_fusion" for line in lines), stderr
    assert any(line.strip().startswith("ddp_fusion_graphs") for line in lines), stderr
