"""Which torch release this is: what differs between releases of the tested window is
decided here, from the minor version, once (no private torch)."""

from __future__ import annotations

import torch


def minor_version(version: str | None = None) -> str:
    """``"2.14"`` for ``"2.14.1+cu130"`` (and for a pre-release of 2.14); torch's own
    version by default."""
    return ".".join(str(version or torch.__version__).split("+")[0].split(".")[:2])
