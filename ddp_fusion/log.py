"""ddp_fusion's logs, registered with torch's logging.

* ``TORCH_LOGS=ddp_fusion``: INFO: each model adopted or wrapped (parameters, bucket
  caps, group, algorithm), each bucket plan the first time it runs, graphs served
  from Inductor's FX graph cache. ``TORCH_LOGS=+ddp_fusion``: DEBUG as well.
* ``TORCH_LOGS=ddp_fusion_graphs``: the before and after graph of every graph the pass
  changes (off by default, even with ``+ddp_fusion``).
* ``TORCH_TRACE=<dir>``: the bucket plan and the graphs as structured artifacts under
  each graph's compile id (``ddp_fusion_plan``, ``ddp_fusion_before``,
  ``ddp_fusion_after``), which ``tlparse`` shows.

Warnings go to the same ``ddp_fusion`` logger, so they show without ``TORCH_LOGS``.
torch loads ddp_fusion's entry point (``_autoload``) when it is imported, before it
parses ``TORCH_LOGS``, so these names are accepted there and listed by
``TORCH_LOGS=help``. With entry points off (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``),
torch parses ``TORCH_LOGS`` before ddp_fusion has registered anything:
``TORCH_LOGS=ddp_fusion`` (or ``+ddp_fusion``) still works, because torch takes an
unknown name that is an importable module as that module's logger (and imports the
package to find its submodules, so ddp_fusion is imported by torch itself), but
``TORCH_LOGS=ddp_fusion_graphs`` is refused by ``import torch`` ("Invalid log
settings"), which ddp_fusion cannot change. Nothing is parsed again at a later import.
"""

from __future__ import annotations

import logging

from . import _torch

NAME = "ddp_fusion"
GRAPHS = "ddp_fusion_graphs"
ARTIFACTS = {
    GRAPHS: ("ddp_fusion: the graph before and after fusion, for every graph the pass changes", True),
}

log = logging.getLogger(NAME)


def _register() -> logging.Logger:
    try:
        _torch.logs.register(NAME, ARTIFACTS)
        return _torch.logs.artifact_logger(NAME, GRAPHS)
    except Exception as e:  # noqa: BLE001 - a torch without these: check_torch() names it later
        log.debug("ddp_fusion: could not register with torch's logging: %r", e)
        return logging.getLogger(f"{NAME}.graphs")


graphs_log = _register()
