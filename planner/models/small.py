"""Small models that are not transformers, for tests and for the sharding search."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MLPStack", "SmallCNN", "MLPMixer"]


class MLPStack(nn.Module):
    """Linear-GELU layers of the given widths: (batch, widths[0]) -> (batch, widths[-1])."""

    def __init__(self, widths: tuple[int, ...] = (256, 1024, 1024, 256)) -> None:
        super().__init__()
        self.widths = widths
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i + 1 < len(self.layers):
                x = F.gelu(x)
        return x

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(batch_size, self.widths[0]),)


class SmallCNN(nn.Module):
    """Three conv-ReLU-pool stages and a linear classifier on (batch, 3, 32, 32) images."""

    def __init__(self, channels: tuple[int, ...] = (32, 64, 128), num_classes: int = 10) -> None:
        super().__init__()
        widths = (3, *channels)
        self.convs = nn.ModuleList(
            nn.Conv2d(a, b, kernel_size=3, padding=1) for a, b in itertools.pairwise(widths)
        )
        side = 32 // 2 ** len(channels)
        self.head = nn.Linear(channels[-1] * side * side, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = F.max_pool2d(F.relu(conv(x)), 2)
        return self.head(x.flatten(1))

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(batch_size, 3, 32, 32),)


class MixerBlock(nn.Module):
    def __init__(self, tokens: int, channels: int, hidden: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(channels)
        self.token_mix = nn.Sequential(
            nn.Linear(tokens, hidden), nn.GELU(), nn.Linear(hidden, tokens)
        )
        self.norm2 = nn.LayerNorm(channels)
        self.channel_mix = nn.Sequential(
            nn.Linear(channels, 4 * channels), nn.GELU(), nn.Linear(4 * channels, channels)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.token_mix(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mix(self.norm2(x))


class MLPMixer(nn.Module):
    """MLP-Mixer on (batch, tokens, channels) patch embeddings."""

    def __init__(self, tokens: int = 64, channels: int = 128, depth: int = 4) -> None:
        super().__init__()
        self.tokens, self.channels = tokens, channels
        self.layers = nn.ModuleList(MixerBlock(tokens, channels, 2 * tokens) for _ in range(depth))
        self.norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).mean(dim=1))

    def example_inputs(self, batch_size: int) -> tuple[torch.Tensor, ...]:
        return (torch.randn(batch_size, self.tokens, self.channels),)
