"""Samples and tokens of language-model batches that are plain tensors (issue 50, items 1-3):
token ids as an integer ``(B, T)`` tensor, time-major ``(seq, batch)`` input, and the
micro-batches of a step that accumulates gradients. The references are plain counts over
the batches the loop fed (``data.shape[1]``, ``data.numel()``, their sums)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

import torchtrace as tt
from torchtrace.api import get_runtime
from torchtrace.measure.batch import infer_batch
from torchtrace.measure.batch_layout import sequence_layout

VOCAB = 50


class RNNModel(torch.nn.Module):
    """PyTorch's word-language model, small: embedding, time-major LSTM or GRU, decoder."""

    def __init__(self, kind: str = "LSTM", d: int = 16) -> None:
        super().__init__()
        self.encoder = torch.nn.Embedding(VOCAB, d)
        self.rnn = getattr(torch.nn, kind)(d, d, 2)
        self.decoder = torch.nn.Linear(d, VOCAB)

    def forward(self, data, hidden=None):
        output, hidden = self.rnn(self.encoder(data), hidden)
        return self.decoder(output), hidden


class TransformerModel(torch.nn.Module):
    """The word-language model's Transformer: nn.TransformerEncoder, batch_first=False."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.encoder = torch.nn.Embedding(VOCAB, d)
        layer = torch.nn.TransformerEncoderLayer(d, 2, 32, dropout=0.0)
        self.transformer = torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.decoder = torch.nn.Linear(d, VOCAB)

    def forward(self, data, hidden=None):
        mask = torch.nn.Transformer.generate_square_subsequent_mask(data.size(0))
        return self.decoder(self.transformer(self.encoder(data), mask=mask, is_causal=True)), hidden


class TinyGPT(torch.nn.Module):
    """nanoGPT's shape of model: ``model(idx, targets)`` with ``idx`` of shape (B, T)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, d)
        self.attn = torch.nn.Linear(d, 3 * d)
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, idx, targets):
        x = self.wte(idx)
        q, k, v = self.attn(x).split(x.size(-1), dim=-1)
        x = x + F.scaled_dot_product_attention(q, k, v, is_causal=True)
        logits = self.head(x)
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _batches(n: int, seq: int, batch: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The word-language model's ``get_batch``: (seq, batch) ids and their flattened targets."""
    g = torch.Generator().manual_seed(seed)
    source = torch.randint(0, VOCAB, (n * seq + 1, batch), generator=g)
    return [(source[i:i + seq], source[i + 1:i + 1 + seq].reshape(-1)) for i in range(0, n * seq, seq)]


def _records(n: int) -> list[dict]:
    return get_runtime().history.steps()[-n:]


@pytest.mark.parametrize("make", [lambda: RNNModel("LSTM"), lambda: RNNModel("GRU"), TransformerModel])
def test_word_language_model_counts_batch_samples_and_every_token(tmp_path, make):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    torch.manual_seed(0)
    model = make()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    @tt.debug_operation(model=model, optimizer=opt)
    def train_step(data, targets):
        opt.zero_grad()
        output, _ = model(data)
        loss = F.cross_entropy(output.view(-1, VOCAB), targets)
        loss.backward()
        opt.step()
        return loss

    batches = _batches(4, 35, 20)
    for data, targets in batches:
        train_step(data, targets)
    records = _records(len(batches))
    assert [r["samples"] for r in records] == [data.shape[1] for data, _ in batches]  # 20, not 35
    assert [r["tokens"] for r in records] == [data.numel() for data, _ in batches]  # 700


def test_nanogpt_loop_in_a_debug_context_counts_tokens(tmp_path):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, VOCAB, (4, 24), generator=g), torch.randint(0, VOCAB, (4, 24), generator=g))
               for _ in range(4)]
    for x, y in batches:
        with tt.debug_context("train_step", model=model, optimizer=opt):
            _, loss = model(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    records = _records(len(batches))
    assert [r["samples"] for r in records] == [x.shape[0] for x, _ in batches]
    assert [r["tokens"] for r in records] == [x.numel() for x, _ in batches]


def test_float_input_to_a_model_with_an_embedding_is_not_tokens():
    model = torch.nn.ModuleDict({"pos": torch.nn.Embedding(8, 4), "proj": torch.nn.Linear(4, 4)})
    assert infer_batch((torch.randn(6, 8, 4),), {}, model=model).tokens is None
    assert infer_batch((torch.ones(6, 8, dtype=torch.long),), {}, model=model).tokens == 48
    # without the model nothing is known of the ids: as before
    assert infer_batch((torch.ones(6, 8, dtype=torch.long),), {}).tokens is None
    # 1-d class labels beside float inputs are not the first tensor
    assert infer_batch((torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2])), {}, model=model).tokens is None


def test_a_model_whose_layout_cannot_be_told_keeps_the_first_dimension_and_says_so(caplog):
    class Mixed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.rnn = torch.nn.LSTM(4, 4, batch_first=True)
            self.attn = torch.nn.MultiheadAttention(4, 2)  # batch_first=False

    model = Mixed()
    with caplog.at_level(logging.WARNING, logger="torchtrace"):
        first = infer_batch((torch.randn(6, 9, 4),), {}, model=model)
        again = infer_batch((torch.randn(6, 9, 4),), {}, model=model)
    assert first.samples == again.samples == 6
    warned = [r for r in caplog.records if "cannot be told" in r.getMessage()]
    assert len(warned) == 1 and "Mixed" in warned[0].getMessage()
    assert sequence_layout(model).ambiguous


def test_batch_first_models_read_the_first_dimension():
    model = torch.nn.ModuleList([torch.nn.Embedding(VOCAB, 8), torch.nn.LSTM(8, 8, batch_first=True)])
    size = infer_batch((torch.ones(3, 11, dtype=torch.long),), {}, model=model)
    assert (size.samples, size.tokens) == (3, 33)


class CRNN(torch.nn.Module):
    """A CRNN text recogniser: a conv backbone over ``(B, 1, H, W)`` images, its columns fed to a
    time-major LSTM (``batch_first=False``) as ``(W, B, C)`` by the model's own permute."""

    def __init__(self) -> None:
        super().__init__()
        self.cnn = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.AdaptiveAvgPool2d((1, 16)))
        self.rnn = torch.nn.LSTM(8, 16)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, images):
        columns = self.cnn(images).squeeze(2).permute(2, 0, 1)
        return self.fc(self.rnn(columns)[0])


class PatchAttention(torch.nn.Module):
    """CLIP's vision transformer shape: patches of ``(B, 3, H, W)`` images, permuted to
    ``(L, B, D)`` for a time-major ``nn.MultiheadAttention``."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = torch.nn.Conv2d(3, 16, 8, 8)
        self.attn = torch.nn.MultiheadAttention(16, 2)
        self.head = torch.nn.Linear(16, 5)

    def forward(self, images):
        x = self.patch(images).flatten(2).permute(2, 0, 1)
        return self.head(self.attn(x, x, x, need_weights=False)[0].mean(0))


@pytest.mark.parametrize("make, image", [(CRNN, (1, 32, 100)), (PatchAttention, (3, 32, 32))])
def test_images_into_a_model_that_makes_them_time_major_itself_count_the_first_dimension(tmp_path, make, image):
    """No sequence module takes a 4-d tensor: the model turns the images into a sequence itself,
    so the batch is their first dimension (it read the second: 1 image channel, 3 colours)."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    try:
        torch.manual_seed(0)
        model = make()
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        @tt.debug_operation(name="train_step", model=model, optimizer=opt)
        def train_step(images, labels):
            opt.zero_grad()
            loss = model(images).pow(2).mean()
            loss.backward()
            opt.step()
            return loss

        images, labels = torch.randn(32, *image), torch.randint(0, 10, (32,))
        train_step(images, labels)
        record = get_runtime().history.last_record
        assert (record.samples, record.tokens) == (images.shape[0], None)
    finally:
        tt.shutdown()


def _accumulating_step(model, opt, micro_batches):
    """nanoGPT's loop: a forward and a backward per micro-batch, then one update."""
    for x, y in micro_batches:
        _, loss = model(x, y)
        (loss / len(micro_batches)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_gradient_accumulation_in_one_debug_context_counts_every_micro_batch(tmp_path):
    import copy

    from torch.utils.flop_counter import FlopCounterMode

    from torchtrace.measure.flop_rules import RULES

    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(2)
    steps = [[(torch.randint(0, VOCAB, (4, 24), generator=g), torch.randint(0, VOCAB, (4, 24), generator=g))
              for _ in range(4)] for _ in range(5)]
    twin = copy.deepcopy(model)
    with FlopCounterMode(display=False, custom_mapping=RULES) as reference:
        _accumulating_step(twin, torch.optim.AdamW(twin.parameters(), lr=1e-3), steps[0])
    for micro_batches in steps:
        with tt.debug_context("train_step", model=model, optimizer=opt):
            _accumulating_step(model, opt, micro_batches)
    records = _records(len(steps))
    assert [r["samples"] for r in records] == [sum(x.shape[0] for x, _ in mb) for mb in steps]  # 16
    assert [r["tokens"] for r in records] == [sum(x.numel() for x, _ in mb) for mb in steps]  # 384
    flops = [r["flops"] for r in records]
    assert flops[0] == reference.get_total_flops() and all(f == flops[0] for f in flops), flops


def test_two_views_of_a_batch_before_one_backward_still_have_no_one_batch_and_say_so(tmp_path, caplog):
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    model = torch.nn.Linear(8, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with caplog.at_level(logging.WARNING, logger="torchtrace"):
        for _ in range(3):
            x = torch.randn(6, 8)
            with tt.debug_context("two_views", model=model, optimizer=opt):
                loss = (model(x + 0.1) - model(x - 0.1)).pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
    assert [r.get("samples") for r in _records(3)] == [None, None, None]
    told = [r for r in caplog.records if "no backward between" in r.getMessage()]
    assert len(told) == 1 and "two_views" in told[0].getMessage()


def test_a_critic_called_on_several_batches_in_a_step_whose_arguments_give_the_batch_says_nothing(tmp_path, caplog):
    """A WGAN-GP critic step, decorated with its real batch as argument, calls the critic on
    generated samples, on the real ones and on interpolates (for the gradient penalty) before
    one backward. The step's arguments give its batch (32 samples), so the model's calls are
    not needed for it: no warning that its steps get no samples, and every step has its 32."""
    tt.configure(prometheus_port="off", run_dir=str(tmp_path), register_atexit=False, strict=True)
    critic = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LeakyReLU(0.2), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(critic.parameters(), lr=1e-4)

    @tt.debug_operation(name="critic", model=critic, optimizer=opt)
    def critic_step(real):
        opt.zero_grad()
        fake = torch.randn_like(real)
        mix = torch.rand(real.shape[0], 1)
        between = (mix * real + (1 - mix) * fake).requires_grad_(True)
        out = critic(between)
        grad, = torch.autograd.grad(out, between, torch.ones_like(out), create_graph=True)
        loss = critic(fake).mean() - critic(real).mean() + 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()
        loss.backward()
        opt.step()

    with caplog.at_level(logging.WARNING, logger="torchtrace"):
        for _ in range(3):
            critic_step(torch.randn(32, 16))
    assert [r.get("samples") for r in _records(3)] == [32, 32, 32]
    assert not [r for r in caplog.records if "no samples" in r.getMessage()], caplog.text
