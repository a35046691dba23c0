"""ddp_fusion's entry point in torch's ``torch.backends`` group (pyproject.toml).

torch 2.13 loads every entry point of that group when it is imported, before it parses
``TORCH_LOGS`` (so that extensions can register log names), unless
``TORCH_DEVICE_BACKEND_AUTOLOAD=0``. Loading it imports ``ddp_fusion``, which registers
its log names (log.py) and applies the ``DDP_FUSION*`` environment variables: so
``DDP_FUSION=1`` takes effect in a script that never imports ddp_fusion (an HF Trainer,
Lightning or Accelerate run). Since this runs in every ``import torch``, it never raises
(a bad ``DDP_FUSION*`` value is a warning here and an error at the first DDP model
built) and stays cheap: it imports neither Dynamo nor Inductor, with ``DDP_FUSION=1``
too (which patches torch DDP's constructor only; the rest waits for the first use).
"""


def load() -> None:
    """Nothing beyond importing the package (done by importing this module)."""
