"""A small training script for the job tests: steps with checkpoints, then a signal.

Run as ``python trainer.py CONFIG_JSON``. CONFIG keys: ``log`` (a JSON-lines file where the
script writes its own timestamps: the tests' reference), ``ckpt_dir``, ``resume`` (a step to
torch.load, or null), ``save_at`` (steps after which to torch.save), ``stop_at`` (after this
step print READY and wait for a signal; null: run to ``last`` and exit), ``last``,
``step_s`` (seconds a step sleeps), ``hold_in_step_at`` (inside this step, after its update, print
READY and wait for a signal: a step the signal interrupts), ``handler`` / ``handler_after`` (install an application
SIGTERM handler before / after configure()), ``blob_mb`` (size of the checkpoint's extra tensor).
"""

import json
import os
import signal
import sys
import time

import torch

config = json.loads(sys.argv[1])
log_fd = os.open(config["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)


def log(**event):
    event.setdefault("t", time.time())
    event["pid"] = os.getpid()
    os.write(log_fd, (json.dumps(event) + "\n").encode())


if config.get("handler"):
    def app_handler(signum, frame):
        log(ev="app_handler", signum=signum)
        sys.exit(143)

    signal.signal(signal.SIGTERM, app_handler)

import torchtrace as tt  # noqa: E402

if config.get("dist"):
    import torch.distributed as dist

    dist.init_process_group("gloo")
tt.configure(prometheus_port="off")
log(ev="configured")
if config.get("handler_after"):
    def late_handler(signum, frame):
        log(ev="app_handler", signum=signum)
        sys.exit(143)

    signal.signal(signal.SIGTERM, late_handler)
torch.manual_seed(0)
model = torch.nn.Linear(32, 32)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
blob = torch.zeros(int(config.get("blob_mb", 8) * 262144))
first = 0
if config.get("resume") is not None:
    t0 = time.perf_counter()
    state = torch.load(os.path.join(config["ckpt_dir"], f"ckpt{config['resume']}.pt"))
    log(ev="load", s=time.perf_counter() - t0, step=state["step"])
    model.load_state_dict(state["model"])
    first = state["step"] + 1
x = torch.randn(16, 32)
for step in range(first, config["last"] + 1):
    start = time.time()
    with tt.debug_context("train_step", model=model, optimizer=opt, step=step) as s:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        time.sleep(config.get("step_s", 0.03))
        if config.get("dist"):
            dist.all_reduce(torch.ones(4))
        s.record_loss(loss)
        if step == config.get("hold_in_step_at"):
            log(ev="held", step=step, start=start)
            print("READY", step, flush=True)
            time.sleep(120)
    log(ev="step", step=step, start=start, end=time.time())
    if step in config.get("save_at", []):
        t0 = time.perf_counter()
        torch.save({"step": step, "model": model.state_dict(), "blob": blob},
                   os.path.join(config["ckpt_dir"], f"ckpt{step}.pt"))
        log(ev="save", s=time.perf_counter() - t0, step=step)
    if step == config.get("kill_at") and int(os.environ.get("RANK", "0")) == config.get("kill_rank"):
        time.sleep(1.2)  # (the black box has this step before the kill: it is rewritten every 0.5 s)
        log(ev="self_kill", step=step)
        os.kill(os.getpid(), signal.SIGKILL)
    if step == config.get("stop_at"):
        log(ev="ready", step=step)
        print("READY", step, flush=True)
        time.sleep(120)
log(ev="done")
