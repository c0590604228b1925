"""torchtrace in a Hugging Face Trainer run: one callback, a span per optimizer step.

    pip install "torchtrace[transformers]"
    python examples/transformers_callback.py

The model is built from a config (no download). ``max_grad_norm=0`` hands clipping to the
callback, so spans and metrics carry the gradient norm before clipping, as measured by
torchtrace, and the Trainer computes no clipping of its own.
"""
import torch
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

import torchtrace as tt
from torchtrace.integrations.transformers import TorchtraceCallback


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n=256, length=32, vocab=100):
        self.ids = torch.randint(0, vocab, (n, length))
        self.labels = (self.ids[:, 0] % 2).long()

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


if __name__ == "__main__":
    result = tt.configure(service_name="transformers-example", prometheus_port=0, guard="skip")
    print("metrics:", result.metrics_url)
    config = BertConfig(vocab_size=100, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=128, max_position_embeddings=32, num_labels=2)
    args = TrainingArguments(output_dir="hf-example-out", max_steps=50, per_device_train_batch_size=16,
                             report_to=[], save_strategy="no", logging_steps=25, max_grad_norm=0.0)
    trainer = Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=RandomTokens(),
                      callbacks=[TorchtraceCallback(max_grad_norm=1.0)])  # the one line
    trainer.train()
    tt.shutdown()
    print("spans:", result.spans_path, "report:", result.report_path)
