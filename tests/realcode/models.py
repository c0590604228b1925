"""Small models with the shapes of real training code, written for these tests, and the four
planted faults of the real-code suite.

- :class:`TinyGPT`: a GPT-style decoder (token and position embeddings, pre-norm blocks of
  causal self-attention and an MLP, a final norm, a language-model head); ``forward(idx,
  targets)`` returns ``(logits, loss)``. ``idx`` may be token ids or, as Hugging Face's
  ``inputs_embeds``, float embeddings (the way a NaN reaches a token model's input).
- :class:`TinyLSTM`: a word-language-model shape (embedding, LSTM, decoder) whose hidden state
  is carried from one batch to the next, trained with a hand-written SGD update.

The faults (:data:`FAULTS`), each with the cause and module a forensic report must name:

- ``inf_weight``: one weight element set to Inf (a corrupted parameter): ``parameter``;
- ``attention_overflow``: the query/key projection scaled up until the attention scores
  overflow to Inf inside the attention module's own forward: ``forward``;
- ``huge_lr``: one parameter group's learning rate set to :data:`HUGE_LR` for one update:
  that group's weights jump to about 1e36, finite but past float32's extreme magnitude, and
  the next step's forward overflows: ``parameter``, the group's module (where the overflow
  happened is the report's ``found_in``);
- ``nan_input``: a NaN in the batch's float input (embeddings, or the LSTM's carried hidden
  state): ``input``, at the model's root.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

VOCAB = 32
D_MODEL = 16
N_HEAD = 2
SEQ = 6
ATTENTION_SCALE = 1e20  # q and k near 4e20: their products overflow float32
HUGE_LR = 1e38  # SGD: the group's weights jump to about 1e36, the next forward overflows

FAULTS = ("inf_weight", "attention_overflow", "huge_lr", "nan_input")
CAUSES = {"inf_weight": "parameter", "attention_overflow": "forward", "huge_lr": "parameter", "nan_input": "input"}


class CausalSelfAttention(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = torch.nn.Linear(D_MODEL, 3 * D_MODEL)
        self.c_proj = torch.nn.Linear(D_MODEL, D_MODEL)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, N_HEAD, c // N_HEAD).transpose(1, 2) for z in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(c // N_HEAD)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        return self.c_proj(y)


class MLP(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_fc = torch.nn.Linear(D_MODEL, 4 * D_MODEL)
        self.gelu = torch.nn.GELU()
        self.c_proj = torch.nn.Linear(4 * D_MODEL, D_MODEL)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(D_MODEL)
        self.attn = CausalSelfAttention()
        self.ln_2 = torch.nn.LayerNorm(D_MODEL)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class TinyGPT(torch.nn.Module):
    def __init__(self, n_layer: int = 2) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, D_MODEL)
        self.wpe = torch.nn.Embedding(SEQ, D_MODEL)
        self.h = torch.nn.ModuleList(Block() for _ in range(n_layer))
        self.ln_f = torch.nn.LayerNorm(D_MODEL)
        self.lm_head = torch.nn.Linear(D_MODEL, VOCAB, bias=False)

    def forward(self, idx, targets):
        tok = self.wte(idx) if not idx.is_floating_point() else idx
        x = tok + self.wpe(torch.arange(tok.shape[1], device=tok.device))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return logits, F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


class TinyLSTM(torch.nn.Module):
    """Embedding, LSTM, decoder; ``forward(ids, hidden)`` returns ``(log_probs, hidden)``.

    Its logits are divided by ``temperature`` in its own forward: an LSTM has no attention, so
    its overflow fault is a temperature near zero, the overflow made by the root's own code."""

    def __init__(self) -> None:
        super().__init__()
        self.encoder = torch.nn.Embedding(VOCAB, D_MODEL)
        self.rnn = torch.nn.LSTM(D_MODEL, D_MODEL, num_layers=1)
        self.decoder = torch.nn.Linear(D_MODEL, VOCAB)
        self.temperature = 1.0

    def forward(self, ids, hidden):
        out, hidden = self.rnn(self.encoder(ids), hidden)
        return F.log_softmax(self.decoder(out) / self.temperature, dim=-1), hidden

    def init_hidden(self, batch: int):
        return (torch.zeros(1, batch, D_MODEL), torch.zeros(1, batch, D_MODEL))


def gpt_batch(generator: torch.Generator, batch: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, VOCAB, (batch, SEQ), generator=generator)
    return idx, torch.roll(idx, -1, dims=1)


def nan_embeddings(model: TinyGPT, idx: torch.Tensor) -> torch.Tensor:
    """The batch as float embeddings (``inputs_embeds``) with one NaN in it."""
    with torch.no_grad():
        embeds = model.wte(idx).clone()
    embeds[0, 1, 2] = float("nan")
    return embeds


def plant_inf_weight(linear: torch.nn.Module) -> None:
    with torch.no_grad():
        linear.weight.view(-1)[0] = float("inf")


def plant_attention_overflow(c_attn: torch.nn.Module) -> torch.Tensor:
    """Scale the query/key rows of the attention projection; returns the weight to put back."""
    saved = c_attn.weight.detach().clone()
    rows = 2 * c_attn.weight.shape[0] // 3 if c_attn.weight.shape[0] % 3 == 0 else c_attn.weight.shape[0]
    with torch.no_grad():
        if c_attn.weight.shape[0] == 3 * D_MODEL:
            c_attn.weight[:rows] *= ATTENTION_SCALE  # nn.Linear: (out, in), q and k first
        else:
            c_attn.weight[:, :2 * D_MODEL] *= ATTENTION_SCALE  # Hugging Face Conv1D: (in, out)
    return saved


def put_back(param: torch.Tensor, saved: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(saved)


def gpt_param_groups(model: torch.nn.Module, head: str) -> list[dict]:
    """Two parameter groups: the module ``head``'s parameters, and the rest (where a huge
    learning rate is planted in the first)."""
    own = [p for n, p in model.named_parameters() if n.startswith(head + ".")]
    ids = {id(p) for p in own}
    return [{"params": own}, {"params": [p for p in model.parameters() if id(p) not in ids]}]
