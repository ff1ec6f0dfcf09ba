"""Tiny workloads for the A/B tests and the CLI (`--workload tests.ab.workloads:mlp`)."""
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, width: int = 128, depth: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(self.norm(x))


def mlp(batch: int = 64, width: int = 128, seed: int = 0):
    torch.manual_seed(seed)
    model = MLP(width)
    return model, (torch.randn(batch, width),)


def mlp_train(batch: int = 64, width: int = 128):
    model, (x,) = mlp(batch, width)
    target = torch.randint(0, 10, (batch,))
    return model, (x,), lambda out: F.cross_entropy(out, target)
