"""A loss handed to a seed API is read as the core step reads it: a tensor of one value is
the loss; a per-sample loss (``reduction="none"``) is refused with the core's sentence, not
read as its first element."""

from __future__ import annotations

import logging

import torch

from torchtrace.compat import AsyncTrainingLogger


def per_sample_loss() -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return torch.nn.functional.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 1), reduction="none")


def test_a_per_sample_loss_is_refused_as_the_core_step_refuses_it(caplog):
    """Before, ``update_progress(loss=<shape [8, 1]>)`` logged and returned element 0 (0.235)
    as the loss. Now the loss is not read (None) and the warning is the core step's: "a loss
    of shape [8, 1] is not a scalar; record loss.mean() or loss.sum()"."""
    loss = per_sample_loss()
    logger = AsyncTrainingLogger()
    try:
        with caplog.at_level(logging.WARNING):
            progress = logger.update_progress(epoch=0, step=0, loss=loss)
        assert progress["loss"] is None
        assert "a loss of shape [8, 1] is not a scalar; record loss.mean() or loss.sum()" in caplog.text
        assert logger.update_progress(epoch=0, step=1, loss=loss.mean())["loss"] == loss.mean().double().item()
        assert logger.update_progress(epoch=0, step=2, loss=loss[:1])["loss"] == loss[0, 0].double().item()
    finally:
        logger.close()


def test_the_training_monitor_refuses_a_per_sample_loss_as_the_core_step_does(caplog):
    """``TrainingMonitor.monitor_training_step`` (and ``TrainingDebugger``'s, which calls it)
    read element 0 of a ``[8, 1]`` loss as the loss, and judged it finite though sample 3 was
    NaN. Now the loss is not read, with the core's sentence; a one-value loss is read as before."""
    from torchtrace import TrainingMonitor

    loss = per_sample_loss()
    loss = torch.cat([loss[:3], torch.full((1, 1), float("nan")), loss[4:]])
    monitor = TrainingMonitor()
    with caplog.at_level(logging.WARNING):
        result = monitor.monitor_training_step(None, loss, step=0)
    assert result["loss"] is None
    assert "a loss of shape [8, 1] is not a scalar; record loss.mean() or loss.sum()" in caplog.text
    assert monitor.monitor_training_step(None, loss[:1], step=1)["loss"] == loss[0, 0].double().item()
