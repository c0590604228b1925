"""infer_batch: samples and tokens from a step's arguments, checked against plain counts over the data."""

from __future__ import annotations

import dataclasses
import random
from collections import UserDict

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

from tests.conftest import require_module
from torchtrace.measure.batch import NOTHING, BatchSize, infer_batch


class Sequences(Dataset):
    """Token sequences of random lengths, as plain Python lists."""

    def __init__(self, n: int, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.rows = [[rng.randrange(1, 1000) for _ in range(rng.randrange(1, 40))] for _ in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> list[int]:
        return self.rows[i]


def pad_collate(rows: list[list[int]]) -> dict[str, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}


def test_tensor_batches_sum_to_the_dataset_length():
    data = TensorDataset(torch.randn(103, 5), torch.randint(0, 3, (103,)))
    model, opt = torch.nn.Linear(5, 3), None
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = [infer_batch((model, opt, x, y), {"step": i}) for i, (x, y) in enumerate(DataLoader(data, batch_size=16))]
    assert [s.samples for s in seen] == [16] * 6 + [7]
    assert sum(s.samples for s in seen) == sum(1 for _ in data)  # plain count of the rows
    assert all(s.tokens is None for s in seen)


class Detection(Dataset):
    """Images of different sizes with their boxes, as torchvision's detection datasets give them."""

    def __len__(self) -> int:
        return 11

    def __getitem__(self, i: int):
        boxes = torch.tensor([[0.0, 0.0, 4.0, 4.0]] * (1 + i % 3))
        return torch.rand(3, 16 + i, 20 + 2 * i), {"boxes": boxes, "labels": torch.ones(len(boxes), dtype=torch.long)}


@pytest.mark.parametrize("call", ["images, targets", "batch"])
def test_detection_batches_count_images_not_channels(call):
    """torchvision's reference collate, ``tuple(zip(*batch))``: a tuple of images and a tuple
    of target dicts. Read by its first tensor, a batch was 3 samples (an image's channels)."""
    model = torch.nn.Conv2d(3, 4, 3)
    loader = DataLoader(Detection(), batch_size=4, collate_fn=lambda rows: tuple(zip(*rows)))
    seen = []
    for images, targets in loader:
        args = (model, list(images), list(targets)) if call == "images, targets" else (model, (images, targets))
        seen.append(infer_batch(args, {}).samples)
    assert seen == [4, 4, 3] and sum(seen) == len(Detection())  # plain count of the images
    # what is not such a pair reads as before: an (inputs, labels) list, a list of dicts alone
    assert infer_batch(([torch.zeros(8, 3), torch.zeros(8)],), {}).samples == 8
    assert infer_batch(([{"x": torch.zeros(5, 2)}, {"x": torch.zeros(5, 2)}],), {}).samples == 5


class Photos(Dataset):
    """Images of different sizes with a class label each, in the form ``form`` names."""

    def __init__(self, form: str, n: int = 13) -> None:
        self.form, self.n = form, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        image, label = torch.rand(3, 10 + i, 12 + 2 * (i % 4)), i % 5
        if self.form == "dict":
            return {"image": image, "label": label, "path": f"img{i}.png"}
        if self.form == "mask":
            return image, torch.ones(image.shape[1:]) > 0.5
        if self.form == "tensor label":
            return image, torch.tensor(label)
        return image, label


def _by_columns(rows):
    images, labels = zip(*rows)
    return list(images), torch.tensor(labels)


@pytest.mark.parametrize("form, collate, call", [
    ("pair", lambda rows: rows, "batch"),              # collate_fn=lambda rows: rows
    ("tensor label", lambda rows: rows, "batch"),
    ("dict", lambda rows: rows, "batch"),               # a datasets-style row per sample
    ("mask", lambda rows: rows, "batch"),               # an image and its mask: two tensors, no shared batch dimension
    ("pair", _by_columns, "images, labels"),            # a list of images beside a label tensor
    ("pair", lambda rows: tuple(list(c) for c in zip(*rows)), "images, labels"),  # beside a list of ints
    ("pair", _by_columns, "batch"),                     # the same pair as one tuple
])
def test_images_of_different_sizes_count_images_not_channels(form, collate, call):
    """Images that cannot be stacked (different sizes), given one by one: as a list of
    ``(image, label)`` rows, of dicts, of ``(image, mask)`` pairs, or as a list of images
    beside their labels. Read by the first tensor, a batch was 3 samples (an image's
    channels). Reference: a plain count of the dataset's rows."""
    model = torch.nn.Conv2d(3, 4, 3)
    data = Photos(form)
    seen = []
    for batch in DataLoader(data, batch_size=4, collate_fn=collate):
        args = (model, *batch) if call == "images, labels" else (model, batch)
        seen.append(infer_batch(args, {}).samples)
    assert seen == [4, 4, 4, 1] and sum(seen) == len(data)


def test_rows_one_by_one_are_told_from_micro_batches_and_batch_parts():
    """What the rows-one-by-one rule leaves alone: micro-batches (tensors sharing a first
    dimension), rows of unlike forms, a list of one row, a list of images without labels
    (nothing says they are samples: read as before), a row holding another kind of object."""
    x, y = torch.randn(8, 4), torch.randn(8)
    assert infer_batch(([(x, y), (x, y), (x, y)],), {}).samples == 24  # micro-batches, summed
    image = torch.rand(3, 9, 9)
    assert infer_batch(([(image, 1), (image, "cat")],), {}).samples == 2  # a label of any plain type
    assert infer_batch(([(image, 1), (torch.rand(3, 9, 9).double(), 1)],), {}).samples == 3  # unlike: the first
    assert infer_batch(([(image, 1)],), {}).samples == 1  # a last batch of one row
    assert infer_batch(([image, image],), {}).samples == 3  # images alone: as before
    assert infer_batch(([(image, object()), (image, object())],), {}).samples == 3
    assert infer_batch(([image, image], torch.zeros(5)), {}).samples == 3  # labels of another length
    targets = {"cls": torch.zeros(8), "box": torch.zeros(8, 4)}  # batched targets beside batched inputs
    assert infer_batch(([(x, targets), (x, targets)],), {}).samples == 8
    boxes = {"boxes": torch.zeros(2, 4), "labels": torch.zeros(2)}  # one image's targets
    assert infer_batch(([(image, boxes)] * 5,), {}).samples == 5  # rows of images with their boxes
    three = {"boxes": torch.zeros(3, 4), "labels": torch.zeros(3)}  # as many boxes as channels, in one row
    assert infer_batch(([(image, boxes), (image, three), (image, boxes), (image, boxes)],), {}).samples == 4
    pairs = [(torch.randint(0, 9, (n,)), torch.randint(0, 9, (m,))) for n, m in ((5, 7), (6, 6), (4, 9))]
    assert infer_batch((pairs,), {}).samples == 3  # source and target sequences, one of equal lengths
    assert infer_batch(([x, x], torch.zeros(8)), {}).samples == 8  # two views of one batch beside its labels
    labels = torch.zeros(8, dtype=torch.long)
    assert infer_batch(([x, labels], [0.1, 0.01]), {}).samples == 8  # an (inputs, labels) list beside two rates
    assert infer_batch(([x, labels], torch.tensor([1, 3])), {}).samples == 8  # ... beside two class weights: unlike
    assert infer_batch(([x, x], torch.tensor([0.3, 0.7])), {}).samples == 8  # two views beside float weights


@pytest.mark.parametrize("as_kwargs", [False, True])
def test_padded_dict_batches_count_only_real_tokens(as_kwargs):
    data = Sequences(57)
    samples = tokens = 0
    for batch in DataLoader(data, batch_size=8, collate_fn=pad_collate):
        size = infer_batch((), batch) if as_kwargs else infer_batch((batch,), {})
        assert isinstance(size.tokens, torch.Tensor) and size.tokens.dim() == 0 and size.pending
        assert size.tokens.dtype == torch.int64
        assert int(size.tokens) < batch["input_ids"].numel() or batch["attention_mask"].all()
        samples += size.samples
        tokens += int(size.tokens)
    assert samples == len(data.rows)
    assert tokens == sum(len(row) for row in data.rows)  # plain count of the unpadded sequences


def test_batch_encoding_of_transformers():
    transformers = require_module("transformers")
    ids = torch.tensor([[101, 7, 8, 102, 0], [101, 9, 102, 0, 0]])
    enc = transformers.BatchEncoding({"input_ids": ids, "attention_mask": (ids != 0).long()})
    size = infer_batch((enc,), {})
    assert size.samples == 2 and int(size.tokens) == 7
    assert int(infer_batch((), enc).tokens) == 7  # model(**batch) style


def test_input_ids_without_a_usable_mask_count_every_position():
    ids = torch.ones(3, 10, dtype=torch.long)
    assert infer_batch(({"input_ids": ids},), {}) == BatchSize(3, 30)
    wrong_shape = {"input_ids": ids, "attention_mask": torch.ones(3, 9)}
    assert infer_batch((wrong_shape,), {}) == BatchSize(3, 30)
    assert infer_batch(({"input_ids": torch.ones(12, dtype=torch.long)},), {}) == BatchSize(1, 12)


@pytest.mark.parametrize("bounds", [False, True])
def test_a_packed_row_counts_its_sequences(bounds):
    """transformers' DataCollatorWithFlattening packs the batch's sequences into one row with
    no mask: samples are the sequences (a plain count of the rows it was given: from the
    flash-attention boundaries when they are there, a host shape; else from the position ids,
    a device count), tokens every position."""
    transformers = require_module("transformers")
    collate = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=bounds)
    data = Sequences(57, seed=3)
    samples = tokens = 0
    for start in range(0, len(data), 8):
        rows = data.rows[start:start + 8]
        batch = collate([{"input_ids": row} for row in rows], return_tensors="pt")
        assert batch["input_ids"].shape[0] == 1 and "attention_mask" not in batch
        size = infer_batch((), batch)
        assert isinstance(size.samples, torch.Tensor) != bounds and size.pending != bounds
        samples += int(size.samples)
        tokens += size.tokens
        assert int(size.samples) == len(rows)
    assert samples == len(data.rows) and tokens == sum(len(row) for row in data.rows)


def test_a_list_of_token_micro_batches_counts_them_all():
    """A step given the micro-batches it accumulates over (a list of padded tokenizer
    outputs): the samples and real tokens of all of them, against a plain count over the
    rows; a list with something else beside them reads as before (its first answer)."""
    data = Sequences(30, seed=5)
    micro = [pad_collate(data.rows[i:i + n]) for i, n in ((0, 4), (4, 7), (11, 3))]
    size = infer_batch((micro,), {})
    assert int(size.samples) == 14 and size.pending
    assert int(size.tokens) == sum(len(row) for row in data.rows[:14])
    assert int(infer_batch((tuple(micro),), {}).tokens) == int(size.tokens)
    mixed = [micro[0], {"lr": 0.1}]
    assert infer_batch((mixed,), {}).samples == 4
    assert infer_batch(([micro[0]] * 65,), {}).samples == 4  # past the cap: the first one's


def test_one_row_is_one_sample_without_packing_signs():
    one = torch.arange(12).reshape(1, 12)
    assert infer_batch(({"input_ids": one},), {}) == BatchSize(1, 12)
    assert int(infer_batch(({"input_ids": one, "position_ids": torch.arange(12)[None]},), {}).samples) == 1
    padded = {"input_ids": one, "attention_mask": torch.ones(1, 12), "position_ids": torch.zeros(1, 12, dtype=torch.long)}
    assert infer_batch((padded,), {}).samples == 1  # a mask: a padded batch of one row, not a packed one
    blocks = torch.block_diag(torch.ones(5, 5), torch.ones(7, 7))[None, None]  # two sequences' 4-d mask
    packed = {"input_ids": one, "attention_mask": blocks, "position_ids": torch.cat([torch.arange(5), torch.arange(7)])[None]}
    assert int(infer_batch((packed,), {}).samples) == 2 and infer_batch((packed,), {}).tokens == 12
    floats = {"input_ids": one, "position_ids": torch.zeros(1, 12)}
    assert infer_batch((floats,), {}).samples == 1  # position ids are integers


def test_bool_and_float_masks():
    ids = torch.ones(2, 4, dtype=torch.long)
    for mask in (torch.tensor([[True, True, False, False], [True, True, True, False]]),
                 torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])):
        assert int(infer_batch(({"input_ids": ids, "attention_mask": mask},), {}).tokens) == 5


def test_what_is_skipped_and_where_it_looks():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.zeros(6, 2)
    assert infer_batch((model, opt, 3, 0.5, "name", None, torch.tensor(1.0), x), {}).samples == 6
    assert infer_batch((((x, torch.zeros(6)),),), {}).samples == 6  # nested tuples
    assert infer_batch(([torch.zeros(4, 1), x],), {}).samples == 4  # first tensor of a list
    assert infer_batch(({"pixels": torch.zeros(9, 3), "y": x},), {}).samples == 9  # first tensor of a dict
    assert infer_batch((UserDict({"input_ids": torch.ones(2, 3, dtype=torch.long)}),), {}) == BatchSize(2, 6)
    assert infer_batch((model,), {"batch": x}).samples == 6  # keyword values after positionals
    assert infer_batch((), {}) is NOTHING
    assert infer_batch((model, opt, 1, "a"), {"lr": 0.1}) == BatchSize(None, None)

    @dataclasses.dataclass
    class Pair:
        name: str
        images: torch.Tensor
        labels: torch.Tensor

    assert infer_batch((Pair("a", torch.zeros(7, 3), x),), {}).samples == 7  # a dataclass's first tensor field
    assert infer_batch((Pair,), {}) is NOTHING  # the class itself is not a batch

    @dataclasses.dataclass
    class Trainer:  # holds the model: an owner, not a batch, whatever tensors it also holds
        model: torch.nn.Module
        class_weights: torch.Tensor

    assert infer_batch((Trainer(model, torch.ones(4)), torch.zeros(11, 3)), {}).samples == 11


def test_a_numpy_batch_gives_its_rows_and_a_settings_shape_does_not():
    import numpy as np

    class Settings:  # not an array: its shape is not a batch's
        shape = (3, 224, 224)

    assert infer_batch((np.zeros((13, 4), dtype=np.float32), np.zeros(13)), {}).samples == 13
    assert infer_batch(((np.zeros((5, 2)), np.zeros(5)),), {}).samples == 5  # (inputs, labels) of arrays
    assert infer_batch((Settings(), np.zeros((6, 2))), {}).samples == 6
    assert infer_batch((np.float64(2.0), np.int64(3)), {}) is NOTHING  # NumPy scalars are no batch


def test_deep_or_wide_containers_are_not_searched_far():
    buried = [[[[torch.zeros(5, 1)]]]]  # past MAX_DEPTH
    assert infer_batch((buried,), {}) is NOTHING
    wide = ["text"] * 10_000 + [torch.zeros(5, 1)]  # past MAX_ITEMS
    assert infer_batch((wide,), {}) is NOTHING
    gen = (torch.zeros(2) for _ in range(3))
    assert infer_batch((gen,), {}) is NOTHING and len(list(gen)) == 3  # an iterator is never consumed


def test_overrides_replace_inferred_values():
    size = infer_batch(({"input_ids": torch.ones(2, 3, dtype=torch.long)},), {})
    assert size.with_overrides() is size
    assert size.with_overrides(samples=5) == BatchSize(5, 6)
    assert size.with_overrides(tokens=4) == BatchSize(2, 4)


def test_no_host_read(monkeypatch):
    """Only shapes and a device-side count: no .item(), .tolist(), bool(), int() or float()."""
    reads = []
    for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda t, *a, _n=name, _o=original, **k: reads.append(_n) or _o(t, *a, **k))
    batch = pad_collate(Sequences(8).rows)
    packed = {"input_ids": torch.ones(1, 9, dtype=torch.long), "position_ids": torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])}
    for args, kwargs in (((batch,), {}), ((), batch), ((batch["input_ids"], torch.zeros(8)), {}), ((packed,), {})):
        infer_batch(args, kwargs)
    assert reads == []


def test_a_list_of_tensor_micro_batches_counts_them_all():
    """Micro-batches of ``(inputs, targets)`` pairs or of mappings (a step that accumulates
    gradients over them): their samples summed, against a plain count. Not summed: the parts
    of one batch (not alike), per-sample pairs (an image and its label: no batch dimension two
    tensors agree on), a list with something else beside them, a list past the cap."""
    g = torch.Generator().manual_seed(3)
    sizes = (8, 8, 8, 5)
    pairs = [(torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)) for n in sizes]
    assert infer_batch((pairs,), {}).samples == sum(sizes)
    assert infer_batch((tuple(list(p) for p in pairs),), {}).samples == sum(sizes)
    dicts = [{"x": x, "y": y} for x, y in pairs]
    assert infer_batch((dicts,), {}).samples == sum(sizes)
    images, masks, labels = torch.randn(6, 3, 8, 8), torch.ones(6, 8, 8), torch.zeros(6, dtype=torch.long)
    assert infer_batch((((images, masks), (labels, labels.float())),), {}).samples == 6  # one batch's parts
    per_sample = [(torch.randn(3, 8, 8), torch.tensor(1)) for _ in range(5)]
    assert infer_batch((per_sample,), {}).samples == 5  # samples one by one (below), not micro-batches of 3
    assert infer_batch(([pairs[0], {"lr": 0.1}],), {}).samples == 8
    assert infer_batch(([pairs[0], (torch.randn(8, 4), torch.randn(8))],), {}).samples == 8  # not alike (dtype)
    assert infer_batch(([pairs[0]] * 65,), {}).samples == 8  # past the cap: the first one's


@pytest.mark.parametrize("lengths", [[5, 6, 7, 5], [6, 7], [3]])
def test_a_packed_sequence_counts_its_sequences_not_its_time_steps(lengths):
    """``pack_padded_sequence``'s batch (an RNN's input, alone or beside its labels): samples
    are its sequences, as many as the lengths given, not the time steps of all of them."""
    from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence

    padded = pad_sequence([torch.randn(n, 4) for n in lengths], batch_first=True)
    packed = pack_padded_sequence(padded, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
    labels = torch.zeros(len(lengths), dtype=torch.long)
    assert infer_batch((packed, labels), {}).samples == len(lengths)
    assert infer_batch((packed,), {}).samples == len(lengths)
    assert infer_batch(({"x": packed, "y": labels},), {}).samples == len(lengths)


def test_a_seq2seq_batch_of_time_major_sequences_and_their_lengths_counts_its_pairs():
    """PyTorch's seq2seq tutorials' batch: ``((src, src_lengths), (tgt, tgt_lengths))``, each
    sequence batch padded time-major, ``(time, batch)``, beside the lengths
    ``pack_padded_sequence`` takes. Six pairs of 8 and 5 tokens: before, the two parts were read
    as two samples one by one (2); now 6, the lengths' count."""
    src, src_len = torch.randint(0, 50, (8, 6)), torch.full((6,), 8)
    tgt, tgt_len = torch.randint(0, 50, (5, 6)), torch.full((6,), 5)
    assert infer_batch((((src, src_len), (tgt, tgt_len)),), {}).samples == 6
    assert infer_batch(((src, src_len), (tgt, tgt_len)), {}).samples == 6
    assert infer_batch(((src, src_len),), {}).samples == 6
    # Micro-batches of (inputs, labels) stay micro-batches: their lengths agree with the first dimension.
    pairs = [(torch.randint(0, 50, (6, 8)), torch.zeros(6, dtype=torch.long))] * 2
    assert infer_batch((pairs,), {}).samples == 12
