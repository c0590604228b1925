"""Helpers for the debug API tests: raw HTTP requests and a tiny training loop."""

from __future__ import annotations

import http.client
import json

import torch

import torchtrace as tt
from torchtrace.api import get_runtime


def call(port: int, method: str, path: str, headers: dict[str, str] | None = None, body: bytes | None = None,
         host: str | None = None) -> tuple[int, dict, bytes]:
    """One request on a fresh connection; ``host`` replaces the Host header."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        hdrs = {"Host": host if host is not None else f"127.0.0.1:{port}"}
        hdrs.update(headers or {})
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, dict(resp.getheaders()), data
    finally:
        conn.close()


def get_json(port: int, path: str) -> dict:
    status, _, body = call(port, "GET", path)
    assert status == 200, (status, body)
    return json.loads(body)


class Trainer:
    """A TinyNet regression trained with debug_context; ``nan_at`` steps get a NaN loss."""

    def __init__(self, model: torch.nn.Module, nan_at: tuple[int, ...] = ()) -> None:
        self.model = model
        self.opt = torch.optim.SGD(model.parameters(), lr=0.05)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(32, 8, generator=g)
        self.y = torch.randn(32, 4, generator=g)
        self.nan_at = set(nan_at)
        self.i = 0

    def step(self) -> None:
        with tt.debug_context("train_step", model=self.model, optimizer=self.opt, inputs=self.x) as scope:
            loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
            if self.i in self.nan_at:
                loss = loss * float("nan")
            self.opt.zero_grad()
            loss.backward()
            scope.record_loss(loss)
            if self.i not in self.nan_at:
                self.opt.step()
        self.i += 1

    def run(self, n: int) -> None:
        for _ in range(n):
            self.step()
        tt.flush()


def runtime():
    rt = get_runtime(create=False)
    assert rt is not None
    return rt
