"""The models the dry-run benchmark plans and measures, as source text: the same text is executed in
the driving process (for the dry run) and in a cell on every rank (for the measurement), so both sides
build exactly the same model and batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

GPT_SOURCE = """
import torch
from torch import nn

class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))

class GPT(nn.Module):
    def __init__(self, vocab, d, heads, layers, context):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))
"""


@dataclass(frozen=True)
class Case:
    """A model (``source`` defines ``build()``), a batch expression over the source's names, and the
    loss each step differentiates (the dry run's default step takes an output's mean, or its
    ``loss`` where it has one)."""

    name: str
    source: str
    batch: str
    loss: str = "model(batch).float().mean()"

    def builder(self) -> Any:
        """The ``build`` function the source defines, for the dry run in this process."""
        space: dict[str, Any] = {}
        exec(self.source, space)
        return space["build"]

    def batch_value(self) -> Any:
        """The batch, made here from the source's names."""
        space: dict[str, Any] = {}
        exec(self.source, space)
        return eval(self.batch, space)


def zoo_case(name: str) -> Case:
    """A model of ``tests/zoo.py`` (built from a ``transformers`` config) as a case."""
    from tests import zoo

    code = zoo.code(name)
    source = f"_CODE = {code!r}\nexec(_CODE)\ndef build():\n    space = {{}}\n    exec(_CODE, space)\n"
    source += "    return space['model']\n"
    return Case(name, source, "make_batch(8)", "model(**batch).loss")


ZOO = ("gpt2 tied", "llama tied", "llama untied", "bert mlm", "t5", "vit", "resnet", "mixtral moe", "lstm")


CASES = (
    Case(
        "MLP 8x1024",
        "import torch\nfrom torch import nn\n"
        "def build():\n"
        "    layers = [m for _ in range(8) for m in (nn.Linear(1024, 1024), nn.ReLU())]\n"
        "    return nn.Sequential(*layers, nn.Linear(1024, 1))\n",
        "torch.randn(64, 1024)",
    ),
    Case(
        "small GPT (4x256, vocab 4096)",
        GPT_SOURCE + "\ndef build():\n    return GPT(4096, 256, 4, 4, 128)\n",
        "torch.randint(0, 4096, (8, 128))",
    ),
    Case(
        "large embedding (100k x 128)",
        "import torch\nfrom torch import nn\n"
        "class Bag(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.emb = nn.Embedding(100_000, 128)\n"
        "        self.mlp = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 8))\n"
        "    def forward(self, idx):\n"
        "        return self.mlp(self.emb(idx).mean(1))\n"
        "def build():\n    return Bag()\n",
        "torch.randint(0, 100_000, (64, 16))",
    ),
)


def gpt_7b() -> nn.Module:
    """A GPT-style stack of about 6.7 billion parameters (32 layers of width 4096, vocab 32000)."""
    space: dict[str, Any] = {}
    exec(GPT_SOURCE, space)
    model: nn.Module = space["GPT"](32000, 4096, 32, 32, 2048)
    return model


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["CASES", "GPT_SOURCE", "ZOO", "Case", "gpt_7b", "parameter_count", "zoo_case"]
