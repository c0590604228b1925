"""Module and parameter names as the user's own model spells them.

A model handed over inside a wrapper names everything under the wrapper's attribute:
``DistributedDataParallel`` and ``DataParallel`` under ``module.``, ``torch.compile`` under
``_orig_mod.``, Lightning Fabric's ``setup`` under ``_forward_module.``, one after the other
when several wrap it. Records, spans and forensic reports
name parameters and modules without them, so a name reads the same whether the job runs
compiled, distributed or neither.
"""

from __future__ import annotations

import torch


def _wrapped(model: torch.nn.Module) -> tuple[str, torch.nn.Module] | None:
    """(the attribute, the module) a wrapper holds the model under; None for a model that is
    not a wrapper."""
    if isinstance(model, (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)):
        return "module", model.module
    # By class name, not imported: torch.compile's (dynamo) and Lightning Fabric's.
    for wrapper, attribute in (("OptimizedModule", "_orig_mod"), ("_FabricModule", "_forward_module")):
        inner = getattr(model, attribute, None)
        if type(model).__name__ == wrapper and isinstance(inner, torch.nn.Module):
            return attribute, inner
    return None


def wrapper_prefix(model: torch.nn.Module | None) -> str:
    """What the wrappers around ``model`` put before the user's names, outermost first.

    >>> wrapper_prefix(torch.nn.DataParallel(torch.nn.Linear(2, 2)))
    'module.'
    >>> wrapper_prefix(torch.nn.Linear(2, 2))
    ''
    """
    prefix = ""
    while model is not None:
        found = _wrapped(model)
        if found is None:
            break
        attribute, model = found
        prefix += attribute + "."
    return prefix


def user_name(name: str, prefix: str) -> str:
    """``name`` (from the wrapped model's ``named_parameters`` or ``named_modules``) as the
    user's model spells it: without ``prefix`` (:func:`wrapper_prefix`). A wrapper module, and
    the user's model itself, are the root: ``""``.

    >>> user_name("module._orig_mod.mlp.c_fc.weight", "module._orig_mod.")
    'mlp.c_fc.weight'
    >>> user_name("module", "module._orig_mod."), user_name("module.module.x", "module.")
    ('', 'module.x')
    """
    if not prefix:
        return name
    if name.startswith(prefix):
        return name[len(prefix):]
    if name == "" or prefix.startswith(name + "."):
        return ""
    return name


__all__ = ["user_name", "wrapper_prefix"]
