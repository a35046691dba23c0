"""The Lightning Trainer with DDP communication hooks, as its users set them up:
``DDPStrategy(ddp_comm_state=..., ddp_comm_hook=..., ddp_comm_wrapper=...,
model_averaging_period=...)``, which registers the hook with Lightning's
``_register_ddp_comm_hook`` and, for post-local SGD, averages the parameters every
``model_averaging_period`` steps after the optimizer step. The LightningModule is
``torch.compile``d (Lightning compiles its training step). ddp_fusion needs one line
before ``trainer.fit``.

Lightning registers comm hooks on CUDA only; on CPU (this example) a two-line strategy
subclass registers them the same way.

    torchrun --nproc_per_node 2 examples/lightning_comm_hooks.py --hook powersgd
"""

import lightning  # noqa: F401  (before torch.compile: Lightning records compile settings)
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.overrides.distributed import _register_ddp_comm_hook
from lightning.pytorch.strategies import DDPStrategy
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

import ddp_fusion
from ddp_fusion._torch.distributed import AllReduces
from _common import dataset, finish, model, parse_args

HOOKS = {
    "fp16": lambda: {"ddp_comm_hook": default_hooks.fp16_compress_hook},
    "powersgd": lambda: {
        "ddp_comm_state": powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2),
        "ddp_comm_hook": powerSGD_hook.powerSGD_hook,
        "ddp_comm_wrapper": default_hooks.fp16_compress_wrapper,
    },
    # gradients averaged for 2 steps, then kept local; parameters averaged every 2 steps
    "post_local_sgd": lambda: {
        "ddp_comm_state": post_localSGD_hook.PostLocalSGDState(
            process_group=None, subgroup=None, start_localSGD_iter=2,
            post_local_gradient_allreduce=False),
        "ddp_comm_hook": post_localSGD_hook.post_localSGD_hook,
        "model_averaging_period": 2,
    },
}


class CPUHookedDDPStrategy(DDPStrategy):
    def _register_ddp_hooks(self) -> None:  # Lightning's own, without its CUDA-only check
        _register_ddp_comm_hook(model=self.model, ddp_comm_state=self._ddp_comm_state,
                                ddp_comm_hook=self._ddp_comm_hook, ddp_comm_wrapper=self._ddp_comm_wrapper)


class Module(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = model()

    def training_step(self, batch, batch_idx):
        (x,) = batch
        return self.net(x).square().mean()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class CountLastStep(Callback):
    """All-reduces of the last training step (with its optimizer step and averaging)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.collectives = steps, None

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.ddp = trainer.strategy.model  # the DDP (fit unwraps it when it ends)
        if trainer.global_step == self.steps - 1:
            self.counting = AllReduces().__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.steps:
            self.counting.__exit__(None, None, None)
            self.collectives = self.counting.count


def main() -> None:
    args = parse_args(__doc__, extra=lambda p: p.add_argument("--hook", choices=HOOKS, default="powersgd"))
    if args.mode == "fused":
        ddp_fusion.config.enabled = True  # the one line: before fit() wraps the model
    module = Module()
    count = CountLastStep(args.steps)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=CPUHookedDDPStrategy(**HOOKS[args.hook]()),
        max_steps=args.steps, logger=False, enable_checkpointing=False, callbacks=[count],
        enable_progress_bar=False, enable_model_summary=False,
    )
    loader = torch.utils.data.DataLoader(dataset(args.steps), batch_size=8)
    trainer.fit(torch.compile(module) if args.mode == "fused" else module, loader)
    finish(args, count.ddp, count.collectives)


if __name__ == "__main__":
    main()
