"""Lightning language models: each batch's span has its tokens and samples, with gradient
accumulation too (issue 50, item 5). Reference: a plain count over the batches the loader gave."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import require_module

pl = require_module("lightning.pytorch")

import torchtrace as tt  # noqa: E402
from tests.helpers import read_spans  # noqa: E402
from torchtrace import semconv  # noqa: E402
from torchtrace.integrations.lightning import TorchtraceCallback  # noqa: E402

VOCAB = 40


class LanguageModel(pl.LightningModule):
    """A Lightning LM whose batch is ``(x, y)`` token ids: ``(B, T)``, or ``(T, B)`` when
    ``time_major`` (the word-language model's layout, for an LSTM with batch_first=False,
    PyTorch's default)."""

    def __init__(self, time_major: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.time_major = time_major
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.rnn = torch.nn.LSTM(16, 16, batch_first=not time_major)
        self.head = torch.nn.Linear(16, VOCAB)
        self.seen: list[tuple[int, int]] = []  # (samples, tokens) of each batch, counted here

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.seen.append((x.shape[1] if self.time_major else x.shape[0], x.numel()))
        out, _ = self.rnn(self.embed(x))
        return F.cross_entropy(self.head(out).flatten(0, 1), y.flatten())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _time_major(rows):
    x, y = torch.utils.data.default_collate(rows)
    return x.t().contiguous(), y.t().contiguous()


def _loader(time_major: bool):
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (24, 13), generator=g)
    data = torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:])
    return torch.utils.data.DataLoader(data, batch_size=6, collate_fn=_time_major if time_major else None)


@pytest.mark.parametrize("accumulate,time_major", [(1, False), (2, False), (2, True)])
def test_lightning_lm_batches_have_their_tokens(tmp_path, accumulate, time_major):
    result = tt.configure(service_name="test", prometheus_port="off", run_dir=str(tmp_path / "runs"), strict=True,
                          register_atexit=False)
    module = LanguageModel(time_major)
    trainer = pl.Trainer(max_steps=4 // accumulate, accelerator="cpu", logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accumulate_grad_batches=accumulate,
                         callbacks=[TorchtraceCallback()])
    trainer.fit(module, _loader(time_major))
    spans = [s for s in read_spans(result.spans_path) if s["name"] == "train_step"]
    assert len(spans) == 4
    assert [s["attributes"].get(semconv.TOKENS) for s in spans] == [t for _, t in module.seen]  # 72 each
    assert [s["attributes"].get(semconv.SAMPLES) for s in spans] == [n for n, _ in module.seen]  # 6 each
