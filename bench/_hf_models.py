"""Where ``tests/_workers_models.py`` imports the ``transformers`` models from; they live
in bench/_lib/models.py."""

from bench._lib.models import HF_BATCH as BATCH
from bench._lib.models import HF_MODELS as MODELS
from bench._lib.models import RealModel
from bench._lib.models import build_hf as build
from bench._lib.models import hf_inputs as inputs_of
from bench._lib.models import hf_loss as loss_of

__all__ = ["BATCH", "MODELS", "RealModel", "build", "inputs_of", "loss_of"]
