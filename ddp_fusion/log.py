"""The ``ddp_fusion`` logger, shared by every module of the package."""

from __future__ import annotations

import logging

log = logging.getLogger("ddp_fusion")
