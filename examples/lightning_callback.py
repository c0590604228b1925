"""torchtrace in a PyTorch Lightning run: one callback, a span per batch, guarded updates.

    pip install "torchtrace[lightning]"
    python examples/lightning_callback.py
"""
import lightning.pytorch as pl
import torch

import torchtrace as tt
from torchtrace.integrations.lightning import TorchtraceCallback


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)  # Lightning's logging is unchanged by torchtrace
        return loss  # torchtrace records it from on_train_batch_end's outputs

    def validation_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


if __name__ == "__main__":
    result = tt.configure(service_name="lightning-example", prometheus_port=0, guard="skip")
    print("metrics:", result.metrics_url)
    x = torch.randn(512, 16)
    data = torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))
    train = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    val = torch.utils.data.DataLoader(data, batch_size=128)
    trainer = pl.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                         callbacks=[TorchtraceCallback()])  # the one line
    trainer.fit(Regressor(), train, val)
    tt.shutdown()
    print("spans:", result.spans_path, "report:", result.report_path)
