"""Rank identity and the collectives torchtrace issues (see :mod:`.collectives`)."""

from torchtrace.distributed.identity import Identity, identity, in_dataloader_worker, rank_file_name

__all__ = ["Identity", "identity", "in_dataloader_worker", "rank_file_name"]
