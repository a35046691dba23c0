"""The flag as users of HF Trainer, Lightning and Accelerate set it: ``DDP_FUSION=1`` in
the environment of a script that never imports ddp_fusion (torch loads it through its
``torch.backends`` entry point); ``TORCH_LOGS`` knows ddp_fusion's names (with entry
points off, only as a module's); nothing is compiled that the user did not compile;
and the entry point costs ``import torch`` next to nothing: without the flag it imports
only ddp_fusion's own modules, with it also only ``replicate()``'s (never Dynamo or
Inductor, which wait for the first DDP model). Each case is a fresh interpreter
(compiled autograd, once a model has run compiled, stays on for the process)."""

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

# What `import torch` imports (run with the entry point off, on, and with DDP_FUSION=1).
MODULES = """
import json, sys, torch
print(json.dumps({"modules": sorted(sys.modules),
                  "enabled": "ddp_fusion" in sys.modules and sys.modules["ddp_fusion"].config.enabled}))
"""

# DDP_FUSION=1: what the import patched, what the first torch DDP adds, what off restores.
FIRST_USE = """
import importlib.util, json, os, sys, torch
DDP = torch.nn.parallel.DistributedDataParallel
# ddp_fusion's own files (not "ddp_fusion" anywhere in the path: CI's venv is under
# /tmp/ddp_fusion_ci.*, torch's files too)
OURS = importlib.util.find_spec("ddp_fusion").submodule_search_locations[0] + os.sep
def state():
    inductor = sys.modules.get("torch._inductor.config")
    slot = inductor.post_grad_custom_post_pass if inductor else None
    return {"init": DDP.__init__.__code__.co_filename.startswith(OURS),
            "forward": DDP._pre_forward.__code__.co_filename.startswith(OURS),
            "pass": type(slot).__name__, "dynamo": "torch._dynamo" in sys.modules}
at_import = state()
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
DDP(torch.nn.Linear(2, 2))
first_ddp = state()
import ddp_fusion
ddp_fusion.config.enabled = False
print(json.dumps({"at_import": at_import, "first_ddp": first_ddp, "off": state()}))
"""

# DDP_FUSION=1, no DDP model: custom data-parallel code calling all_reduce_gradient
# under torch.compile is fused (the pass goes into its slot while the call is traced).
ALL_REDUCE = PRELUDE + """
import ddp_fusion
import torch._inductor.config as inductor_config
before = type(inductor_config.post_grad_custom_post_pass).__name__
@torch.compile(fullgraph=True)
def reduce(a, b):
    return ddp_fusion.all_reduce_gradient(a * 2), ddp_fusion.all_reduce_gradient(b + 1)
reduce(torch.randn(4), torch.randn(4))
print(json.dumps({"before": before, "after": type(inductor_config.post_grad_custom_post_pass).__name__,
                  "fused": counters["ddp_fusion"]["fused_all_reduces"]}))
"""

# Entry points off, TORCH_LOGS=ddp_fusion: torch takes the name as a module's.
ENTRY_POINTS_OFF = PRELUDE + """
import ddp_fusion
ddp_fusion.DistributedDataParallel(net())
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
        "modules_no_entry_point": run("m0", MODULES, TORCH_DEVICE_BACKEND_AUTOLOAD="0"),
        "modules": run("m1", MODULES),
        "modules_flag": run("m2", MODULES, DDP_FUSION="1"),
        "first_use": run("first_use", FIRST_USE, DDP_FUSION="1"),
        "all_reduce": run("all_reduce", ALL_REDUCE, DDP_FUSION="1"),
        "entry_points_off": run("entry_points_off", ENTRY_POINTS_OFF, TORCH_LOGS="ddp_fusion",
                                TORCH_DEVICE_BACKEND_AUTOLOAD="0"),
        "graphs_entry_points_off": run("graphs_off", "import torch", TORCH_LOGS="ddp_fusion_graphs",
                                       TORCH_DEVICE_BACKEND_AUTOLOAD="0"),
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


def test_without_the_flag_the_entry_point_imports_only_ddp_fusion(runs):
    """The modules ``import torch`` adds through the entry point: ddp_fusion's own."""
    bare, _ = _result(runs, "modules_no_entry_point")
    r, _ = _result(runs, "modules")
    assert not r["enabled"]
    added = set(r["modules"]) - set(bare["modules"])
    assert "ddp_fusion" in added and {m for m in added if m.split(".")[0] != "ddp_fusion"} == set()


def test_with_the_flag_import_torch_imports_neither_dynamo_nor_inductor(runs):
    """``DDP_FUSION=1`` adds only the module of ``replicate()``, whose DDP construction
    is patched at import with torch DDP's constructor."""
    plain, _ = _result(runs, "modules")
    r, _ = _result(runs, "modules_flag")
    assert r["enabled"]
    added = set(r["modules"]) - set(plain["modules"])
    assert added and all(m.startswith("torch.distributed._composable") for m in added), sorted(added)
    assert not [m for m in r["modules"] if m.startswith(("torch._dynamo", "torch._inductor"))]


def test_with_the_flag_the_rest_is_installed_at_the_first_ddp_and_undone_when_off(runs):
    r, _ = _result(runs, "first_use")
    assert r["at_import"] == {"init": True, "forward": False, "pass": "NoneType", "dynamo": False}
    assert r["first_ddp"] == {"init": True, "forward": True, "pass": "FuseDDPAllReduces", "dynamo": True}
    assert r["off"] == {"init": False, "forward": False, "pass": "NoneType", "dynamo": True}


def test_with_the_flag_all_reduce_gradient_traced_without_a_ddp_model_is_fused(runs):
    r, _ = _result(runs, "all_reduce")
    assert r == {"before": "NoneType", "after": "FuseDDPAllReduces", "fused": 2}, r


def test_with_entry_points_off_torch_logs_takes_ddp_fusion_as_a_module_name(runs):
    """As the user guide says: torch parses ``TORCH_LOGS`` before ddp_fusion registers
    anything; ``ddp_fusion`` still works (a module's name to torch), the artifact
    ``ddp_fusion_graphs`` is refused by ``import torch`` itself."""
    code, _, stderr = runs["entry_points_off"]
    assert code == 0, stderr
    assert "ddp_fusion: DistributedDataParallel reduces 4 parameters" in stderr, stderr
    code, _, stderr = runs["graphs_entry_points_off"]
    assert code != 0 and "Invalid log settings: ddp_fusion_graphs" in stderr, stderr


def test_torch_logs_help_lists_ddp_fusion(runs):
    """Where torch loads entry points before it parses ``TORCH_LOGS`` (2.13 on); 2.11 and
    2.12 parse it first, as with entry points off, and the user guide says so."""
    from ddp_fusion import _torch

    code, _, stderr = runs["help"]
    assert code != 0  # torch answers TORCH_LOGS=help with the list, as an error
    lines = stderr.splitlines()
    listed = any(line.strip() == "ddp_fusion" for line in lines)
    assert listed == _torch.logs.torch_logs_sees_entry_points(), stderr
    assert listed == any(line.strip().startswith("ddp_fusion_graphs") for line in lines), stderr
