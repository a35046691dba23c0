"""Real models from ``transformers`` configs (random initialisation; no weights are
downloaded), small enough for 2 CPU ranks. Shared by ``bench.real_models`` and the
real-model tests: each entry builds the model and one rank's batch, and says what DDP
needs for it.

* ``gpt2``, ``llama``: causal LM, loss on the input ids.
* ``bert``: masked LM on a ``BertModel`` that keeps its pooler (as a pre-trained
  checkpoint has): the pooler runs but its output is not in the loss, so its
  parameters get no gradient, which is what ``find_unused_parameters`` is for.
* ``vit``: image classification on 32x32 images.
* ``resnet``: image classification; BatchNorm running statistics are buffers, which DDP
  broadcasts from rank 0 at each forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

VOCAB, SEQ, BATCH = 128, 32, 4
# Dropout is off in every config: eager and compiled runs draw different random masks,
# so with it no two runs could be compared.


@dataclass
class RealModel:
    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], dict[str, torch.Tensor]]
    find_unused_parameters: bool = False
    desc: str = ""


def _lm_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids, "next_token": True}


def _mlm_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.where(torch.rand(BATCH, SEQ, generator=gen) < 0.15, ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]  # at least one masked position per row
    return {"input_ids": ids, "labels": labels}


def _image_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.randn(BATCH, 3, 32, 32, generator=gen),
        "labels": torch.randint(0, 4, (BATCH,), generator=gen),
    }


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ))


def _bert() -> nn.Module:
    from transformers import BertConfig, BertForMaskedLM, BertModel

    config = BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        vocab_size=VOCAB, max_position_embeddings=SEQ,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = BertForMaskedLM(config)
    model.bert = BertModel(config, add_pooling_layer=True)  # a checkpoint's pooler
    model.tie_weights()
    return model


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=SEQ,
    ))


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=128, num_labels=4,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))


def _resnet() -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4,
    ))


MODELS: dict[str, RealModel] = {
    "gpt2": RealModel(_gpt2, _lm_batch, desc="GPT-2, 2 layers, d=64"),
    "bert": RealModel(_bert, _mlm_batch, find_unused_parameters=True,
                      desc="BERT masked LM, 2 layers, d=64, unused pooler"),
    "llama": RealModel(_llama, _lm_batch, desc="Llama, 2 layers, d=64"),
    "vit": RealModel(_vit, _image_batch, desc="ViT, 2 layers, d=64, 32x32 images"),
    "resnet": RealModel(_resnet, _image_batch, desc="ResNet, 2 stages, BatchNorm"),
}


def build(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return MODELS[name].build()


def loss_of(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Cross-entropy computed here, not by ``transformers`` (whose loss selection logs a
    warning under torch.compile: a graph break of its own)."""
    logits = model(**inputs_of(batch)).logits
    labels = batch["labels"]
    if batch.get("next_token"):  # causal LM
        logits, labels = logits[:, :-1], labels[:, 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def inputs_of(batch: dict[str, Any]) -> dict[str, Any]:
    """The model's keyword arguments in ``batch``."""
    return {k: v for k, v in batch.items() if k not in ("labels", "next_token")}
