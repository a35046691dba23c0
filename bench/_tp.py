"""Where ``tests/_workers.py`` imports ``TPBlock`` from; it lives in bench/_lib/models.py."""

from bench._lib.models import CopyToTP, ReduceFromTP, TPBlock

__all__ = ["CopyToTP", "ReduceFromTP", "TPBlock"]
