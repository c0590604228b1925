"""The whole job, not only the step: where each rank is, how each attempt ended.

:mod:`torchtrace.job.state` keeps each rank's black box, the small file that another rank,
the next attempt and ``torchtrace why`` read.
"""

from __future__ import annotations

from torchtrace.job.state import RankState, read_states

__all__ = ["RankState", "read_states"]
