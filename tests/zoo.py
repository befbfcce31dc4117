"""Models users train, built from ``transformers`` configs (nothing downloaded), with a batch each.

Dropout is off, so that two ranks on halves of a batch compute what one process computes on both
halves. Each entry is code a rank or a test runs: it defines ``model`` (built under ``torch.manual_seed(0)``)
and ``make_batch(n)``, which returns a batch of ``n`` samples for ``model(**batch)`` with a ``loss``
in the output. ``BLOCKS`` names the class the fsdp strategy must choose as its unit for each. The
sizes are ``WIDTH``, ``VOCAB`` and ``LAYERS`` unless a test passes others to :func:`code`.
"""

from __future__ import annotations

import functools

WIDTH, VOCAB, LAYERS, SEQ = 256, 8192, 2, 16

_TEXT = """
def make_batch(n):
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, {vocab}, (n, {seq}), generator=g)
    return {{"input_ids": ids, "labels": ids}}
"""
_IMAGE = """
def make_batch(n):
    g = torch.Generator().manual_seed(n)
    pixels = torch.randn(n, 3, {size}, {size}, generator=g)
    return {{"pixel_values": pixels, "labels": torch.randint(0, 10, (n,), generator=g)}}
"""

_MODELS: dict[str, str] = {
    "gpt2 tied": """
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config(n_embd={width}, n_layer={layers}, n_head=4, vocab_size={vocab},
    n_positions=64, tie_word_embeddings=True, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    attn_implementation="eager"))
""",
    "gpt2 untied": """
from transformers import GPT2Config, GPT2LMHeadModel
model = GPT2LMHeadModel(GPT2Config(n_embd={width}, n_layer={layers}, n_head=4, vocab_size={vocab},
    n_positions=64, tie_word_embeddings=False, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    attn_implementation="eager"))
""",
    "llama tied": """
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(hidden_size={width}, intermediate_size={width} * 2,
    num_hidden_layers={layers}, num_attention_heads=4, num_key_value_heads=2, vocab_size={vocab},
    max_position_embeddings=64, tie_word_embeddings=True, attn_implementation="eager"))
""",
    "llama untied": """
from transformers import LlamaConfig, LlamaForCausalLM
model = LlamaForCausalLM(LlamaConfig(hidden_size={width}, intermediate_size={width} * 2,
    num_hidden_layers={layers}, num_attention_heads=4, num_key_value_heads=2, vocab_size={vocab},
    max_position_embeddings=64, tie_word_embeddings=False, attn_implementation="eager"))
""",
    "bert mlm": """
from transformers import BertConfig, BertForMaskedLM
model = BertForMaskedLM(BertConfig(hidden_size={width}, num_hidden_layers={layers}, num_attention_heads=4,
    intermediate_size={width} * 2, vocab_size={vocab}, max_position_embeddings=64,
    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation="eager"))
""",
    "t5": """
from transformers import T5Config, T5ForConditionalGeneration
model = T5ForConditionalGeneration(T5Config(d_model={width}, d_ff={width} * 2, d_kv={width} // 4,
    num_layers={layers}, num_decoder_layers={layers}, num_heads=4, vocab_size={vocab},
    decoder_start_token_id=0, pad_token_id=0, dropout_rate=0.0, attn_implementation="eager"))
""",
    "mixtral moe": """
from transformers import MixtralConfig, MixtralForCausalLM
model = MixtralForCausalLM(MixtralConfig(hidden_size={width}, intermediate_size={width},
    num_hidden_layers={layers}, num_attention_heads=4, num_key_value_heads=2, vocab_size={vocab},
    num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=64,
    attn_implementation="eager"))
""",
    "vit": """
from transformers import ViTConfig, ViTForImageClassification
model = ViTForImageClassification(ViTConfig(hidden_size={width}, num_hidden_layers={layers} * 2,
    num_attention_heads=4, intermediate_size={width} * 4, image_size=32, patch_size=4, num_labels=10,
    attn_implementation="eager"))
""",
    "resnet": """
from transformers import ResNetConfig, ResNetForImageClassification
model = ResNetForImageClassification(ResNetConfig(embedding_size=32, hidden_sizes=[32, 64, 128, 256],
    depths=[2, 2, 2, 2], layer_type="basic", num_labels=10))
""",
    "lstm": """
from torch import nn
from transformers.modeling_outputs import CausalLMOutput

class LSTMLanguageModel(nn.Module):
    def __init__(self, vocab, width):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.lstm = nn.LSTM(width, width, num_layers=2, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, labels):
        hidden, _ = self.lstm(self.embed(input_ids))
        logits = self.head(hidden)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        return CausalLMOutput(loss=loss, logits=logits)

model = LSTMLanguageModel({vocab}, {width})
""",
}
IMAGES = frozenset({"vit", "resnet"})
NAMES = tuple(_MODELS)
TIED = frozenset({"gpt2 tied", "llama tied", "bert mlm", "t5"})
#: the class the fsdp strategy's default rule must make a unit of, per model (None: no repeated block)
BLOCKS: dict[str, str | None] = {
    "gpt2 tied": "GPT2Block",
    "gpt2 untied": "GPT2Block",
    "llama tied": "LlamaDecoderLayer",
    "llama untied": "LlamaDecoderLayer",
    "bert mlm": "BertLayer",
    "t5": "T5Block",
    "mixtral moe": "MixtralDecoderLayer",
    "vit": "ViTLayer",
    "resnet": "ResNetBasicLayer",
    "lstm": None,
}


def code(name: str, width: int = WIDTH, vocab: int = VOCAB, layers: int = LAYERS) -> str:
    """Code that defines ``model`` and ``make_batch`` for the zoo's model ``name``."""
    body = _MODELS[name].format(width=width, vocab=vocab, layers=layers)
    # a ResNet's last stage sees 1/32 of the image: 64 pixels leave its BatchNorm more than one value
    size = 64 if name == "resnet" else 32
    batch = (_IMAGE if name in IMAGES else _TEXT).format(vocab=vocab, seq=SEQ, size=size)
    return f"import torch\ntorch.manual_seed(0)\n{body}{batch}"


def build(name: str, **sizes: int) -> tuple[object, object]:
    """``(model, make_batch)`` built here, in this process."""
    scope: dict[str, object] = {}
    exec(code(name, **sizes), scope)
    return scope["model"], scope["make_batch"]


#: what torch raises for an LSTM under CPU autocast to bfloat16 where oneDNN has no such kernel
ONEDNN_LSTM = "could not create a primitive descriptor for the LSTM forward propagation primitive"
#: that error as a pool reports it when both ranks raised it, with the line that says what to do
ONEDNN_LSTM_ON_RANKS = (
    rf"(?s)rank [01] failed first: RuntimeError: {ONEDNN_LSTM}[^\n]*also failed: rank [01]\)\n"
    r".*hint: this CPU's oneDNN has no LSTM kernel in autocast's low precision: run with --precision 32"
)


@functools.cache
def bf16_lstm_runs_here() -> bool:
    """Whether torch runs an LSTM under CPU autocast to bfloat16 on this CPU: its oneDNN kernel needs
    bfloat16 instructions (missing on an AMD EPYC without AVX-512, where torch itself raises
    :data:`ONEDNN_LSTM`, in a plain process as on a rank)."""
    import torch

    lstm, x = torch.nn.LSTM(8, 8, batch_first=True), torch.randn(2, 3, 8)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lstm(x)
    except RuntimeError as exc:
        if ONEDNN_LSTM in str(exc):
            return False
        raise
    return True
