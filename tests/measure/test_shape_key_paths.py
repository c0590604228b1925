"""shape_key's way for every step's arguments (plain tensors, models, tuples and lists of
tensors, keyed in C) gives the keys of the careful way, _key on each argument, for every kind
of argument: the keys are kept in FLOP tables and must not change."""

from __future__ import annotations

import random
from collections import namedtuple

import numpy as np
import pytest
import torch

from torchtrace.measure import shape_keys
from torchtrace.measure.shape_keys import KEY_MAX_ITEMS, shape_key

Pair = namedtuple("Pair", "x y")


def _careful(args: tuple, kwargs: dict) -> tuple:
    out = [shape_keys._key(v, 0) for v in args[:KEY_MAX_ITEMS]]
    out += [(k, shape_keys._key(v, 0)) for k, v in list(kwargs.items())[:KEY_MAX_ITEMS]]
    return tuple(out)


def _values(rng: random.Random) -> list:
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def tensor():
        return torch.zeros(rng.choice([(4, 3), (2,), (), (1, 2, 3)]),
                           dtype=rng.choice([torch.float32, torch.long, torch.bool]))

    return [
        tensor(), model, opt, 7, 0.5, None, "text", (), [], (tensor(), tensor()), [tensor(), tensor(), tensor()],
        (tensor(), 3), [tensor(), [tensor()]], (torch.nn.Parameter(torch.zeros(2)),), Pair(tensor(), tensor()),
        [tensor()] * (KEY_MAX_ITEMS + 3), (tensor(),) * KEY_MAX_ITEMS, np.zeros((2, 3)), (np.zeros(2), tensor()),
        {"ids": tensor()}, [model], (model, tensor()),
        [torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)], layout=torch.jagged)],
    ]


@pytest.mark.parametrize("seed", range(4))
def test_every_steps_way_gives_the_careful_keys(seed):
    rng = random.Random(seed)
    for _ in range(300):
        pool = _values(rng)
        args = tuple(rng.choice(pool) for _ in range(rng.choice([0, 1, 2, 3, KEY_MAX_ITEMS + 2])))
        kwargs = {f"k{i}": rng.choice(pool) for i in range(rng.choice([0, 0, 1, 2]))}
        assert shape_key(args, kwargs) == _careful(args, kwargs), (args, kwargs)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_a_strided_nested_tensor_in_a_tuple_takes_the_careful_way():
    nested = torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)])
    args = (torch.zeros(2), (nested, torch.zeros(1)))
    assert shape_key(args, {}) == _careful(args, {})
    assert not shape_keys.countable(shape_key(args, {}))
