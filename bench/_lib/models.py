"""The models bench trains, their batches and their loss.

* ``mlp``: 24 x (Linear(256, 256) + LayerNorm + GELU) + Linear(256, 1), batch 128: many
  small parameters.
* ``mlp_host``: 100 x (Linear(64, 64) + LayerNorm + GELU) + Linear(64, 1), batch 8: 402
  tiny parameters and almost no compute, so the step is host time (Python per step, per
  bucket, per parameter), the regime a GPU reaches once its kernels are short.
* ``mlp_params``: 100 x (Linear(32, 32) + LayerNorm) + Linear(32, 1), batch 8:
  402 small parameters with fewer operations each than ``mlp_host`` (no activation), so
  the step's host time is what each parameter costs, not each operation.
* ``gpt``: a small GPT (vocab 1000, d 192, 4 heads, 4 pre-LN blocks, seq 64), batch 8.
* ``mlp_tp``: DP=2 x TP=2 on 4 ranks: 8 residual Megatron blocks (W1 split by rows, W2 by
  columns over the TP group; the TP all-reduces are plain functional collectives, which
  ddp_fusion must leave alone), batch 64 per DP rank.
* ``hf_<name>``: tiny ``transformers`` models (GPT-2, BERT, Llama, ViT, ResNet) built
  from configs with random weights (no download), batch 4 (needs the ``integrations``
  extra).

Every model is built from the same seed on every rank and in every mode; each DP rank
gets its own data (TP peers share it), the same in every mode.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.nn import functional as F  # noqa: N812 - torch's own spelling
from torch import nn

from bench._lib import _torch

# --------------------------------------------------------------------------- bench models


class MLP(nn.Module):
    """``depth`` x (Linear(width, width) + LayerNorm + GELU): many small parameters."""

    def __init__(self, width: int = 256, depth: int = 24) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width), nn.GELU())
            for _ in range(depth)
        )
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class ParamChain(nn.Module):
    """``depth`` x (Linear(width, width) + LayerNorm) in torch's own modules,
    under a module of the user's own (Dynamo compiles a user module's forward; a bare
    ``nn.Sequential`` is on its skip list)."""

    def __init__(self, width: int = 32, depth: int = 100) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.LayerNorm(width))
                                    for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token + position embedding, ``layers`` pre-LN blocks, final LN, untied LM head."""

    def __init__(self, vocab: int = 1000, d: int = 192, heads: int = 4, layers: int = 4,
                 seq: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


# --------------------------------------------------------------------------- tensor parallel


class CopyToTP(torch.autograd.Function):
    """Forward: identity. Backward: sum the input gradient over the TP group."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return _torch.functional_all_reduce(grad, "sum", ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """Forward: sum partial outputs over the TP group. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        return _torch.functional_all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class TPBlock(nn.Module):
    """``x + W2 gelu(W1 x + b1) + b2`` with W1 split by rows and W2 by columns over TP.

    Each TP rank holds its slice of the same full weights (drawn from ``seed``), so the
    block computes what one unsplit block would. Shared with the DP x TP tests."""

    def __init__(self, d: int, h: int, tp_group, seed: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        tp_rank, tp_size = tp_group.rank(), tp_group.size()
        self.tp_group = tp_group
        w1 = torch.randn(h, d, generator=g) / d**0.5
        w2 = torch.randn(d, h, generator=g) / h**0.5
        self.w1 = nn.Parameter(w1.chunk(tp_size, 0)[tp_rank].clone())
        self.b1 = nn.Parameter(torch.zeros(h).chunk(tp_size)[tp_rank].clone())
        self.w2 = nn.Parameter(w2.chunk(tp_size, 1)[tp_rank].clone())
        self.b2 = nn.Parameter(torch.zeros(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(F.linear(CopyToTP.apply(x, self.tp_group), self.w1, self.b1))
        return x + ReduceFromTP.apply(F.linear(h, self.w2), self.tp_group) + self.b2


class TPMLP(nn.Module):
    """``depth`` residual :class:`TPBlock` split over the TP group."""

    def __init__(self, tp_group, width: int = 256, hidden: int = 1024, depth: int = 8) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(TPBlock(width, hidden, tp_group, seed) for seed in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


# --------------------------------------------------------------------------- transformers

HF_VOCAB, HF_SEQ, HF_BATCH = 128, 32, 4
# Dropout is off in every config: eager and compiled runs draw different random masks,
# so with it no two runs could be compared.


@dataclass
class RealModel:
    """A ``transformers`` model: how to build it and one rank's batch, and what DDP
    needs for it. Shared with the real-model tests."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.Generator], dict[str, torch.Tensor]]
    find_unused_parameters: bool = False
    desc: str = ""


def _lm_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, HF_VOCAB, (HF_BATCH, HF_SEQ), generator=gen)
    return {"input_ids": ids, "labels": ids, "next_token": True}


def _mlm_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, HF_VOCAB, (HF_BATCH, HF_SEQ), generator=gen)
    labels = torch.where(torch.rand(HF_BATCH, HF_SEQ, generator=gen) < 0.15, ids, torch.full_like(ids, -100))
    labels[:, 0] = ids[:, 0]  # at least one masked position per row
    return {"input_ids": ids, "labels": labels}


def _image_batch(gen: torch.Generator) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.randn(HF_BATCH, 3, 32, 32, generator=gen),
        "labels": torch.randint(0, 4, (HF_BATCH,), generator=gen),
    }


def _gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(
        n_layer=2, n_embd=64, n_head=2, vocab_size=HF_VOCAB, n_positions=HF_SEQ,
        bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    ))


def _bert() -> nn.Module:
    """Masked LM on a ``BertModel`` that keeps its pooler (as a pre-trained checkpoint
    has): the pooler runs but its output is not in the loss, so its parameters get no
    gradient, which is what ``find_unused_parameters`` is for."""
    from transformers import BertConfig, BertForMaskedLM, BertModel

    config = BertConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128,
        vocab_size=HF_VOCAB, max_position_embeddings=HF_SEQ,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    model = BertForMaskedLM(config)
    model.bert = BertModel(config, add_pooling_layer=True)
    model.tie_weights()
    return model


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, vocab_size=HF_VOCAB, max_position_embeddings=HF_SEQ,
    ))


def _vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    return ViTForImageClassification(ViTConfig(
        image_size=32, patch_size=8, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=128, num_labels=4,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    ))


def _resnet() -> nn.Module:
    """BatchNorm running statistics are buffers, which DDP broadcasts at each forward."""
    from transformers import ResNetConfig, ResNetForImageClassification

    return ResNetForImageClassification(ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=4,
    ))


HF_MODELS: dict[str, RealModel] = {
    "gpt2": RealModel(_gpt2, _lm_batch, desc="GPT-2, 2 layers, d=64"),
    "bert": RealModel(_bert, _mlm_batch, find_unused_parameters=True,
                      desc="BERT masked LM, 2 layers, d=64, unused pooler"),
    "llama": RealModel(_llama, _lm_batch, desc="Llama, 2 layers, d=64"),
    "vit": RealModel(_vit, _image_batch, desc="ViT, 2 layers, d=64, 32x32 images"),
    "resnet": RealModel(_resnet, _image_batch, desc="ResNet, 2 stages, BatchNorm"),
}


def build_hf(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return HF_MODELS[name].build()


def hf_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Cross-entropy computed here, not by ``transformers`` (whose loss selection logs a
    warning under torch.compile: a graph break of its own)."""
    logits = model(**hf_inputs(batch)).logits
    labels = batch["labels"]
    if batch.get("next_token"):  # causal LM
        logits, labels = logits[:, :-1], labels[:, 1:]
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def hf_inputs(batch: dict[str, Any]) -> dict[str, Any]:
    """The model's keyword arguments in ``batch``."""
    return {k: v for k, v in batch.items() if k not in ("labels", "next_token")}


# --------------------------------------------------------------------------- registry


@dataclass(frozen=True)
class ModelSpec:
    desc: str
    world_size: int = 2
    tp: int = 1
    hf: str | None = None
    ddp_kwargs: tuple[tuple[str, Any], ...] = ()


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec("MLP: 24 x (Linear(256,256) + LayerNorm + GELU) + Linear(256,1), batch 128"),
    "mlp_host": ModelSpec("host-bound MLP: 100 x (Linear(64,64) + LayerNorm + GELU) + Linear(64,1), "
                          "batch 8: 402 small parameters"),
    "mlp_params": ModelSpec("many-parameter MLP: 100 x (Linear(32,32) + LayerNorm) + "
                            "Linear(32,1), batch 8: 402 small parameters, few operations each"),
    "gpt": ModelSpec("GPT: vocab 1000, d_model 192, 4 heads, 4 blocks, seq 64, batch 8"),
    "mlp_tp": ModelSpec("DP=2 x TP=2 MLP: 8 x Megatron block (256 -> 1024 -> 256, W1 by rows, "
                        "W2 by columns over TP), batch 64 per DP rank", world_size=4, tp=2),
    **{f"hf_{name}": ModelSpec(f"transformers {m.desc}, batch {HF_BATCH}", hf=name,
                               ddp_kwargs=(("find_unused_parameters", m.find_unused_parameters),))
       for name, m in HF_MODELS.items()},
}
MLP_BATCH, MLP_WIDTH = 128, 256
GPT_BATCH, GPT_SEQ, GPT_VOCAB = 8, 64, 1000
TP_BATCH = 64
HOST_BATCH, HOST_WIDTH, HOST_DEPTH = 8, 64, 100
PARAMS_WIDTH, PARAMS_DEPTH = 32, 100


def world_size(model: str, device: str = "cpu", ranks: int | None = None) -> int:
    """Ranks per job: ``ranks`` if given (CPU); else the model's (2, or 4 for DP x TP) on
    CPU; 1 on the one GPU."""
    if device == "cuda":
        return 1
    return ranks or MODELS[model].world_size


def dp_tp_groups(name: str) -> tuple[Any, Any]:
    """``(dp_group, tp_group)`` of this rank for ``name``; ``(None, None)`` for pure DP
    models. DP x TP models use a (dp, tp) device mesh: TP peers are neighbouring ranks."""
    tp = MODELS[name].tp
    if tp == 1:
        return None, None
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size() // tp, tp), mesh_dim_names=("dp", "tp"))
    return mesh["dp"].get_group(), mesh["tp"].get_group()


def make_model(name: str, tp_group: Any = None) -> nn.Module:
    spec = MODELS[name]
    if spec.hf is not None:
        return build_hf(spec.hf)
    torch.manual_seed(0)
    if name == "mlp_tp":
        return TPMLP(tp_group)
    if name == "mlp_host":
        return MLP(HOST_WIDTH, HOST_DEPTH)
    if name == "mlp_params":
        return ParamChain(PARAMS_WIDTH, PARAMS_DEPTH)
    return MLP() if name == "mlp" else GPT()


Batch = tuple[Any, Any]


def make_batches(name: str, rank: int, count: int) -> list[Batch]:
    """``count`` (input, target) pairs; each DP rank its own data (TP peers share it),
    the same for every mode. ``transformers`` models: (batch dict, None)."""
    spec = MODELS[name]
    gen = torch.Generator().manual_seed(1000 + rank // spec.tp)
    if spec.hf is not None:
        return [(HF_MODELS[spec.hf].batch(gen), None) for _ in range(count)]
    out = []
    for _ in range(count):
        if name == "mlp":
            out.append((torch.randn(MLP_BATCH, MLP_WIDTH, generator=gen),
                        torch.randn(MLP_BATCH, 1, generator=gen)))
        elif name == "mlp_host":
            out.append((torch.randn(HOST_BATCH, HOST_WIDTH, generator=gen),
                        torch.randn(HOST_BATCH, 1, generator=gen)))
        elif name == "mlp_params":
            out.append((torch.randn(HOST_BATCH, PARAMS_WIDTH, generator=gen),
                        torch.randn(HOST_BATCH, 1, generator=gen)))
        elif name == "mlp_tp":
            out.append((torch.randn(TP_BATCH, MLP_WIDTH, generator=gen),
                        torch.randn(TP_BATCH, MLP_WIDTH, generator=gen)))
        else:
            ids = torch.randint(0, GPT_VOCAB, (GPT_BATCH, GPT_SEQ + 1), generator=gen)
            out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


def loss_of(name: str, model: nn.Module) -> Callable[[Any, Any], torch.Tensor]:
    """``loss(x, y)`` of ``model`` (``name``'s model, wrapped any way)."""
    if MODELS[name].hf is not None:
        return lambda x, y: hf_loss(model, x)
    if name in ("mlp", "mlp_host", "mlp_params", "mlp_tp"):
        return lambda x, y: (model(x) - y).square().mean()
    return lambda x, y: F.cross_entropy((out := model(x)).reshape(-1, out.shape[-1]), y.reshape(-1))


class _ShapeOnlyGroup:
    """Stands in for TP rank 0's group when only parameter shapes are needed."""

    def __init__(self, size: int) -> None:
        self._size = size

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self._size


def parameters(name: str) -> list[torch.Tensor]:
    """One rank's parameters (a TP rank holds its shards), without a process group."""
    return list(make_model(name, _ShapeOnlyGroup(MODELS[name].tp)).parameters())


def model_info(name: str) -> dict[str, int]:
    """Parameters per rank (a TP rank holds its shards)."""
    params = parameters(name)
    return {"num_params": sum(p.numel() for p in params), "num_tensors": len(params),
            "grad_bytes": sum(p.numel() * p.element_size() for p in params)}
