"""A model handed over inside a wrapper (DataParallel or DistributedDataParallel, torch.compile,
Lightning Fabric's ``setup``, or several) has its parameters named as the user's model names
them, in the record and in the forensic report alike. Before, the record named the wrapper's
attribute first (``_orig_mod.0.weight``, ``module.0.weight``, ``_forward_module.0.weight``)
while the forensic report of the same step named the module without it: a name changed with
the job's wrappers, and one report spoke of the same layer twice, under two names."""

from __future__ import annotations

import pytest
import torch

import torchtrace as tt
from tests.helpers import seeded_batches, small_mlp
from torchtrace.measure.names import user_name, wrapper_prefix


def _fabric(model: torch.nn.Module) -> torch.nn.Module:
    fabric = pytest.importorskip("lightning.fabric")
    return fabric.Fabric(accelerator="cpu", devices=1).setup_module(model)


WRAPPERS = {
    "data_parallel": lambda m: torch.nn.DataParallel(m),
    "compiled": lambda m: torch.compile(m, backend="eager"),
    "data_parallel_of_compiled": lambda m: torch.nn.DataParallel(torch.compile(m, backend="eager")),
    "lightning_fabric": _fabric,
}


@pytest.mark.parametrize("wrapper", list(WRAPPERS))
def test_a_nan_step_names_the_users_parameters(tmp_path, wrapper):
    tt.configure(service_name="test", prometheus_port="off", run_dir=str(tmp_path), strict=True,
                 register_atexit=False, guard="skip")
    try:
        model = small_mlp()
        wrapped = WRAPPERS[wrapper](model)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        @tt.debug_operation(model=wrapped, optimizer=opt)
        def train_step(x):
            opt.zero_grad()
            loss = wrapped(x).pow(2).mean()
            loss.backward()
            opt.step()
            return loss

        for x in seeded_batches(2, nan_at=1):
            train_step(x)
        tt.flush()
        record = tt.api.get_runtime().history.last_record
        assert record.grad_nonfinite_params == ["0.weight", "0.bias", "2.weight", "2.bias"]
        assert record.forensics is not None and record.forensics["cause"] == "input"
    finally:
        tt.shutdown()


def test_the_prefix_is_the_wrappers_own_and_cut_once():
    """The prefix comes from the wrapper objects, outermost first; a module of the user's own
    named ``module`` keeps its name (a name-based cut removed every ``module.``)."""
    inner = torch.nn.Sequential()
    inner.add_module("module", torch.nn.Linear(2, 2))  # the user's own child called "module"
    both = torch.nn.DataParallel(torch.compile(inner, backend="eager"))
    prefix = wrapper_prefix(both)
    assert prefix == "module._orig_mod."
    names = [user_name(n, prefix) for n, _ in both.named_parameters()]
    assert names == [n for n, _ in inner.named_parameters()] == ["module.weight", "module.bias"]
    modules = [user_name(n, prefix) for n, _ in both.named_modules()]
    assert modules == ["", "", "", "module"]  # the two wrappers and the user's root, then its child
    assert wrapper_prefix(inner) == "" and user_name("module.weight", "") == "module.weight"
