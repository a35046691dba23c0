"""The Hugging Face Trainer as its users run it on CPU: ``torchrun`` +
``TrainingArguments(torch_compile=True, ddp_backend="gloo", use_cpu=True)``. The Trainer
prepares its model through Accelerate, which wraps it in torch DDP and compiles the DDP;
ddp_fusion needs one line before the Trainer wraps the model (before ``trainer.train()``;
here before the Trainer is built). The model is a 2-layer GPT-2 built from a config
(tiny width, no download, dropout off so that runs compare exactly).

    torchrun --nproc_per_node 2 examples/hf_trainer_ddp.py
"""

import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import ddp_fusion
from ddp_fusion._torch.distributed import AllReduces
from _common import BUCKET_CAP_MB, finish, parse_args

SEQ, VOCAB = 16, 128
FIND_UNUSED = {"trainer": None, "true": True, "false": False}


def gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    config = GPT2Config(
        vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )
    net = GPT2LMHeadModel(config)
    # named, or transformers warns in the compiled forward at every step ("loss_type=None
    # ... unrecognized"), a graph break (Dynamo cannot trace logging), flag or not
    net.loss_type = "ForCausalLM"
    return net


class Tokens(torch.utils.data.Dataset):
    """Random token sequences (the same on every run; the Trainer's sampler shards them)."""

    def __init__(self, n: int) -> None:
        gen = torch.Generator().manual_seed(100)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=gen)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class CountLastStep(TrainerCallback):
    """All-reduces of the last training step (forward, backward, optimizer step)."""

    def __init__(self, steps: int) -> None:
        self.steps, self.collectives = steps, None

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.steps - 1:
            self.counting = AllReduces().__enter__()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step == self.steps:
            self.counting.__exit__(None, None, None)
            self.collectives = self.counting.count


def _options(parser) -> None:
    parser.add_argument(
        "--find-unused-parameters", choices=["trainer", "true", "false"], default="trainer",
        help="DDP's find_unused_parameters (TrainingArguments.ddp_find_unused_parameters); "
        "trainer: the Trainer's default (true for a transformers model without gradient "
        "checkpointing)")


def main() -> None:
    args = parse_args(__doc__, _options)
    fused = args.mode == "fused"
    if fused:
        ddp_fusion.config.enabled = True  # the one line: before the Trainer wraps the model
    batch = 4
    output_dir = tempfile.TemporaryDirectory(prefix="hf_trainer_ddp_")  # nothing is saved
    training_args = TrainingArguments(
        output_dir=output_dir.name,
        torch_compile=fused,
        ddp_backend="gloo",
        use_cpu=True,
        ddp_bucket_cap_mb=BUCKET_CAP_MB,
        ddp_find_unused_parameters=FIND_UNUSED[args.find_unused_parameters],
        per_device_train_batch_size=batch,
        max_steps=args.steps,
        learning_rate=1e-3,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        seed=0,
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    counter = CountLastStep(args.steps)
    trainer = Trainer(
        model=gpt2(),
        args=training_args,
        train_dataset=Tokens(2 * batch * args.steps),
        callbacks=[counter],
    )
    trainer.train()
    wrapped = trainer.model_wrapped  # OptimizedModule(DDP) compiled, DDP eager
    finish(args, getattr(wrapped, "_orig_mod", wrapped), counter.collectives)
    output_dir.cleanup()
    # the Trainer leaves the process group to the script: destroyed here, not in the
    # interpreter's teardown (where one eager run aborted with "terminate called without
    # an active exception" after its results were written, once)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
