"""Small versions of the blocks of architectures users bring (the project's own code, written from the papers'
descriptions): squeeze-excitation (EfficientNet, MobileNetV3, RegNetY), ghost modules (GhostNet), RepVGG and
MobileOne branches, dense concatenation (DenseNet), Inception branches with a padded average pool, ConvNeXt
blocks (depthwise 7x7, LayerNorm over channels, layer scale), Swin window attention with a relative position
bias, LeViT attention with an attention bias, a MobileViT block (unfold into patches, a transformer, fold back)
and FastViT's token mixer. Two networks put them together: one convolutional, one with attention."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class SqueezeExcite(nn.Module):
    def __init__(self, channels: int, reduced: int) -> None:
        super().__init__()
        self.reduce = nn.Conv2d(channels, reduced, 1)
        self.expand = nn.Conv2d(reduced, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        scale = x.mean((2, 3), keepdim=True)
        return x * torch.sigmoid(self.expand(F.silu(self.reduce(scale))))


class Ghost(nn.Module):
    """Half the channels from a convolution, half from a cheap depthwise one on them (GhostNet)."""

    def __init__(self, channels: int, out: int) -> None:
        super().__init__()
        self.primary = nn.Sequential(nn.Conv2d(channels, out // 2, 1, bias=False), nn.BatchNorm2d(out // 2), nn.ReLU())
        self.cheap = nn.Sequential(
            nn.Conv2d(out // 2, out // 2, 3, padding=1, groups=out // 2, bias=False),
            nn.BatchNorm2d(out // 2),
            nn.ReLU(),
        )

    def forward(self, x: Tensor) -> Tensor:
        primary = self.primary(x)
        return torch.cat([primary, self.cheap(primary)], 1)


class RepBranches(nn.Module):
    """3x3, 1x1 and identity (BatchNorm) branches summed (RepVGG, MobileOne in training form)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.dense = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels))
        self.point = nn.Sequential(nn.Conv2d(channels, channels, 1, bias=False), nn.BatchNorm2d(channels))
        self.identity = nn.BatchNorm2d(channels)

    def forward(self, x: Tensor) -> Tensor:
        return F.relu(self.dense(x) + self.point(x) + self.identity(x))


class DenseLayer(nn.Module):
    def __init__(self, channels: int, growth: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(channels)
        self.conv = nn.Conv2d(channels, growth, 3, padding=1, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return torch.cat([x, self.conv(F.relu(self.norm(x)))], 1)


class InceptionBranches(nn.Module):
    def __init__(self, channels: int, width: int) -> None:
        super().__init__()
        self.one = nn.Conv2d(channels, width, 1)
        self.three = nn.Sequential(nn.Conv2d(channels, width, 1), nn.ReLU(), nn.Conv2d(width, width, 3, padding=1))
        self.pool = nn.Conv2d(channels, width, 1)

    def forward(self, x: Tensor) -> Tensor:
        pooled = F.avg_pool2d(x, 3, stride=1, padding=1)  # padded average pool, as Inception-v3's
        return F.relu(torch.cat([self.one(x), self.three(x), self.pool(pooled)], 1))


class ConvNet(nn.Module):
    """The convolutional blocks in one network: 3 x 32 x 32 in, 10 logits out."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.se = SqueezeExcite(16, 4)
        self.ghost = Ghost(16, 24)
        self.rep = RepBranches(24)
        self.dense = DenseLayer(24, 8)
        self.inception = InceptionBranches(32, 8)
        self.head = nn.Linear(24, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = self.se(self.stem(x))
        x = self.rep(self.ghost(x))
        x = self.inception(self.dense(x))
        return self.head(F.adaptive_avg_pool2d(x, 1).flatten(1))


class ConvNeXtBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.dw = nn.Conv2d(channels, channels, 7, padding=3, groups=channels)
        self.norm = nn.LayerNorm(channels)
        self.up = nn.Linear(channels, 4 * channels)
        self.down = nn.Linear(4 * channels, channels)
        self.gamma = nn.Parameter(torch.full((channels,), 0.5))

    def forward(self, x: Tensor) -> Tensor:
        y = self.dw(x).permute(0, 2, 3, 1)  # channels last for the LayerNorm and the MLP
        y = self.down(F.gelu(self.up(self.norm(y)))) * self.gamma
        return x + y.permute(0, 3, 1, 2)


class WindowAttention(nn.Module):
    """Self-attention inside non-overlapping windows with a learned relative position bias (Swin)."""

    def __init__(self, channels: int, window: int, heads: int) -> None:
        super().__init__()
        self.window, self.heads = window, heads
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Linear(channels, channels)
        self.bias_table = nn.Parameter(torch.randn((2 * window - 1) ** 2, heads) * 0.1)
        coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
        relative = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)
        self.register_buffer("index", relative[..., 0] * (2 * window - 1) + relative[..., 1], persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # x: N, H, W, C
        n, h, w, c = x.shape
        s = self.window
        windows = x.reshape(n, h // s, s, w // s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, s * s, c)
        q, k, v = self.qkv(windows).reshape(-1, s * s, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        bias = self.bias_table[self.index.reshape(-1)].reshape(s * s, s * s, -1).permute(2, 0, 1)
        attention = torch.softmax(q @ k.transpose(-2, -1) * (c // self.heads) ** -0.5 + bias, -1)
        out = self.proj((attention @ v).transpose(1, 2).reshape(-1, s * s, c))
        out = out.reshape(n, h // s, w // s, s, s, c).permute(0, 1, 3, 2, 4, 5).reshape(n, h, w, c)
        return x + out


class BiasedAttention(nn.Module):
    """Attention over all positions with a learned per-head bias indexed by position offsets (LeViT)."""

    def __init__(self, channels: int, tokens: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(channels, 3 * channels)
        self.proj = nn.Sequential(nn.Hardswish(), nn.Linear(channels, channels))
        side = int(tokens**0.5)
        points = [(i, j) for i in range(side) for j in range(side)]
        offsets = {(abs(a[0] - b[0]), abs(a[1] - b[1])) for a in points for b in points}
        number = {offset: i for i, offset in enumerate(sorted(offsets))}
        idx = [[number[(abs(a[0] - b[0]), abs(a[1] - b[1]))] for b in points] for a in points]
        self.biases = nn.Parameter(torch.randn(heads, len(number)) * 0.1)
        self.register_buffer("bias_index", torch.tensor(idx), persistent=False)

    def forward(self, x: Tensor) -> Tensor:  # x: N, T, C
        n, t, c = x.shape
        q, k, v = self.qkv(x).reshape(n, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        attention = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5 + self.biases[:, self.bias_index]
        return x + self.proj((attention.softmax(-1) @ v).transpose(1, 2).reshape(n, t, c))


class MobileViTBlock(nn.Module):
    """Local convolution, unfold into 2x2 patches, a transformer layer across patches, fold back, fuse."""

    def __init__(self, channels: int, dim: int) -> None:
        super().__init__()
        self.local = nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.SiLU(), nn.Conv2d(channels, dim, 1))
        self.norm = nn.LayerNorm(dim)
        self.attention = nn.MultiheadAttention(dim, 2, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
        self.back = nn.Conv2d(dim, channels, 1)
        self.fuse = nn.Conv2d(2 * channels, channels, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        y = self.local(x)
        n, d, h, w = y.shape
        patches = y.reshape(n, d, h // 2, 2, w // 2, 2).permute(0, 3, 5, 2, 4, 1).reshape(n * 4, h * w // 4, d)
        normed = self.norm(patches)
        patches = patches + self.attention(normed, normed, normed, need_weights=False)[0]
        patches = patches + self.mlp(patches)
        y = patches.reshape(n, 2, 2, h // 2, w // 2, d).permute(0, 5, 3, 1, 4, 2).reshape(n, d, h, w)
        return self.fuse(torch.cat([x, self.back(y)], 1))


class RepMixer(nn.Module):
    """FastViT's token mixer: x + depthwise(BN(x)) - BN(x) in its training form, with a layer scale."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm2d(channels)
        self.mixer = nn.Sequential(
            nn.Conv2d(channels, channels, 3, padding=1, groups=channels), nn.BatchNorm2d(channels)
        )
        self.scale = nn.Parameter(torch.full((channels, 1, 1), 0.5))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.scale * (self.mixer(x) - self.norm(x))


class AttentionNet(nn.Module):
    """The attention blocks in one network: 3 x 32 x 32 in, 10 logits out."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1), nn.GELU())
        self.mixer = RepMixer(16)
        self.convnext = ConvNeXtBlock(16)
        self.mobilevit = MobileViTBlock(16, 24)
        self.down = nn.Conv2d(16, 32, 2, stride=2)
        self.window = WindowAttention(32, 4, 2)
        self.levit = BiasedAttention(32, 64, 2)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 10)

    def forward(self, x: Tensor) -> Tensor:
        x = self.mobilevit(self.convnext(self.mixer(self.stem(x))))
        x = self.window(self.down(x).permute(0, 2, 3, 1))  # N, 8, 8, 32
        x = self.levit(x.flatten(1, 2))  # N, 64, 32
        return self.head(self.norm(x).mean(1))


def randomize_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Non-trivial BatchNorm statistics and affine parameters (a freshly made network has none)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.copy_(torch.rand(module.num_features, generator=generator) * 0.4 - 0.2)
                module.running_var.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
                module.weight.copy_(torch.rand(module.num_features, generator=generator) + 0.5)
    return model
