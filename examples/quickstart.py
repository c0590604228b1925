"""torchtrace in twenty lines: every step is a span, a set of metrics and a line in the report."""
import torch

import torchtrace as tt

run = tt.configure(service_name="quickstart", prometheus_port=0)  # optional; 0 = any free port
model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)


@tt.debug_operation(name="train_step", model=model, optimizer=opt)
def train_step(x, y):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss  # torchtrace reads the loss from the return value


for _ in range(100):
    x = torch.randn(32, 16)
    train_step(x, x.sum(dim=1, keepdim=True))
tt.shutdown()  # writes torchtrace-runs/<run_id>/report.json; spans are in spans.jsonl
print(f"100 steps recorded in {run.report_path.parent}/; see them with:\n"
      f"  torchtrace report {run.report_path.parent} --html report.html")
