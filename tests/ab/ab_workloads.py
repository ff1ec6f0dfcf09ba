"""Tiny workloads for the A/B tests and the CLI (`--workload ab_workloads:mlp`)."""
import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """Linear layers (what the test swaps replace), an RMSNorm (a real bundled swap), and a
    BatchNorm and Dropout, whose buffers and randomness ab_test must leave as they were."""

    def __init__(self, width: int = 128, depth: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.bn = nn.BatchNorm1d(width)
        self.drop = nn.Dropout(0.1)
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, 10)

    def forward(self, x):
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(self.norm(self.drop(self.bn(x))))


def mlp(batch: int = 64, width: int = 128):
    torch.manual_seed(0)
    model = MLP(width)
    return model, (torch.randn(batch, width),)


def mlp_train(batch: int = 64, width: int = 128):
    model, (x,) = mlp(batch, width)
    target = torch.randint(0, 10, (batch,))
    return model, (x,), lambda out: F.cross_entropy(out, target)


def not_a_workload():
    return 42


def llama_train_adamw(vocab: int = 250):
    """A tiny Hugging Face Llama with eager attention, an unaligned vocabulary and a foreach AdamW: every
    fix the analyser names for a transformer's training step has something to act on."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab,
                                      attn_implementation="eager", use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (2, 16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    return model, {"input_ids": ids, "labels": ids}, None, optimizer
