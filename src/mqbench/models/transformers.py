"""Tiny transformer models (a ViT and a BERT-style encoder), defined in the project, random init.

Attention is written out by hand (separate q/k/v ``nn.Linear``, ``torch.matmul``,
scaling, softmax, ``torch.matmul``, output ``nn.Linear``) so that quantization
passes see every matmul and linear layer; reshapes use ``x.shape[i]`` and
``reshape``/``transpose`` so the models trace with ``torch.fx.symbolic_trace``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = [
    "BertTiny",
    "MultiHeadSelfAttention",
    "VisionTransformer",
    "bert_tiny",
    "vit_tiny",
]


class MultiHeadSelfAttention(nn.Module):
    """Multi-head self-attention over ``[N, L, dim]`` with an optional additive mask.

    ``mask``, when given, is added to the ``[N, heads, L, L]`` attention scores before
    the softmax (e.g. ``[N, 1, 1, L]`` with large negative values at padding).

    Example:
        >>> import torch
        >>> MultiHeadSelfAttention(dim=16, heads=4)(torch.zeros(2, 5, 16)).shape
        torch.Size([2, 5, 16])
    """

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        if dim % heads != 0:
            raise ValueError(f"dim ({dim}) must be divisible by heads ({heads})")
        self.heads = heads
        self.head_dim = dim // heads
        self.scale = 1.0 / math.sqrt(self.head_dim)
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, dim)

    def _split(self, x: Tensor, b: int, n: int) -> Tensor:
        return x.reshape(b, n, self.heads, self.head_dim).transpose(1, 2)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        b = x.shape[0]
        n = x.shape[1]
        q = self._split(self.q(x), b, n)
        k = self._split(self.k(x), b, n)
        v = self._split(self.v(x), b, n)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        if mask is not None:  # decided by the caller's structure, not by data
            scores = scores + mask
        attn = torch.softmax(scores, dim=-1)
        ctx = torch.matmul(attn, v).transpose(1, 2).reshape(b, n, self.heads * self.head_dim)
        return self.out(ctx)


class _MLP(nn.Sequential):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim))


class _ViTBlock(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = MultiHeadSelfAttention(dim, heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = _MLP(dim, mlp_ratio * dim)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def _init_transformer(model: nn.Module) -> None:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            nn.init.trunc_normal_(m.weight, std=0.02)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.trunc_normal_(m.weight, std=0.02)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class VisionTransformer(nn.Module):
    """ViT: Conv2d patch embedding, class token, learned position embedding, pre-norm blocks.

    Example:
        >>> import torch
        >>> VisionTransformer(image_size=16, patch_size=4, num_classes=3, dim=16, depth=1, heads=2)(
        ...     torch.zeros(2, 3, 16, 16)
        ... ).shape
        torch.Size([2, 3])
    """

    def __init__(
        self,
        image_size: int = 32,
        patch_size: int = 4,
        num_classes: int = 10,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: int = 4,
        in_channels: int = 3,
    ) -> None:
        super().__init__()
        if image_size % patch_size != 0:
            raise ValueError(f"image_size ({image_size}) must be a multiple of patch_size ({patch_size})")
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_patches + 1, dim))
        self.blocks = nn.Sequential(*[_ViTBlock(dim, heads, mlp_ratio) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)
        _init_transformer(self)
        nn.init.trunc_normal_(self.cls_token, std=0.02)
        nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        x = self.patch_embed(x).flatten(2).transpose(1, 2)  # [N, patches, dim]
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1) + self.pos_embed
        x = self.norm(self.blocks(x))
        return self.head(x[:, 0])


def vit_tiny(
    image_size: int = 32,
    patch_size: int = 4,
    num_classes: int = 10,
    dim: int = 64,
    depth: int = 2,
    heads: int = 4,
) -> VisionTransformer:
    """A tiny :class:`VisionTransformer` (about 0.1M parameters with the defaults).

    Example:
        >>> import torch
        >>> vit_tiny()(torch.zeros(2, 3, 32, 32)).shape
        torch.Size([2, 10])
    """
    return VisionTransformer(
        image_size=image_size, patch_size=patch_size, num_classes=num_classes, dim=dim, depth=depth, heads=heads
    )


class _BertLayer(nn.Module):
    """Post-norm encoder layer: ln(x + attn(x, mask)), then ln(x + ffn(x))."""

    def __init__(self, dim: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.attn = MultiHeadSelfAttention(dim, heads)
        self.norm1 = nn.LayerNorm(dim, eps=1e-12)
        self.ffn = _MLP(dim, mlp_ratio * dim)
        self.norm2 = nn.LayerNorm(dim, eps=1e-12)

    def forward(self, x: Tensor, mask: Tensor) -> Tensor:
        x = self.norm1(x + self.attn(x, mask))
        return self.norm2(x + self.ffn(x))


class BertTiny(nn.Module):
    """BERT-style encoder with a pooler and classifier: ``forward(input_ids, attention_mask) -> logits``.

    ``attention_mask`` is ``[N, L]`` with 1 for tokens to keep and 0 for padding; it
    becomes the additive mask ``(1 - mask[:, None, None, :]) * -10000.0``.  Token-type
    ids are all zero (single segment).  Sequences may be up to ``max_len`` long.

    Example:
        >>> import torch
        >>> model = BertTiny(vocab_size=50, dim=16, depth=1, heads=2, max_len=8, num_classes=3)
        >>> model(torch.zeros(2, 6, dtype=torch.long), torch.ones(2, 6, dtype=torch.long)).shape
        torch.Size([2, 3])
    """

    def __init__(
        self,
        vocab_size: int = 1000,
        dim: int = 64,
        depth: int = 2,
        heads: int = 4,
        max_len: int = 64,
        num_classes: int = 2,
        mlp_ratio: int = 4,
        type_vocab_size: int = 2,
    ) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab_size, dim)
        self.position_embeddings = nn.Embedding(max_len, dim)
        self.token_type_embeddings = nn.Embedding(type_vocab_size, dim)
        self.embed_norm = nn.LayerNorm(dim, eps=1e-12)
        self.layers = nn.ModuleList([_BertLayer(dim, heads, mlp_ratio) for _ in range(depth)])
        self.pooler = nn.Linear(dim, dim)
        self.pooler_act = nn.Tanh()
        self.classifier = nn.Linear(dim, num_classes)
        _init_transformer(self)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        # 0, 1, ..., L-1 per row, built with traceable ops (no Python slicing by a traced length).
        positions = torch.ones_like(input_ids).cumsum(dim=1) - 1
        x = (
            self.word_embeddings(input_ids)
            + self.position_embeddings(positions)
            + self.token_type_embeddings(torch.zeros_like(input_ids))
        )
        x = self.embed_norm(x)
        mask = (1 - attention_mask[:, None, None, :].to(x.dtype)) * -10000.0
        for layer in self.layers:
            x = layer(x, mask)
        pooled = self.pooler_act(self.pooler(x[:, 0]))
        return self.classifier(pooled)


def bert_tiny(
    vocab_size: int = 1000,
    dim: int = 64,
    depth: int = 2,
    heads: int = 4,
    max_len: int = 64,
    num_classes: int = 2,
) -> BertTiny:
    """A tiny :class:`BertTiny` encoder classifier (about 0.17M parameters with the defaults).

    Example:
        >>> import torch
        >>> ids = torch.randint(0, 1000, (2, 16))
        >>> mask = torch.ones(2, 16, dtype=torch.long)
        >>> bert_tiny()(ids, mask).shape
        torch.Size([2, 2])
    """
    return BertTiny(vocab_size=vocab_size, dim=dim, depth=depth, heads=heads, max_len=max_len, num_classes=num_classes)
