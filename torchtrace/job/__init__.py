"""The whole job, not only the step: where each rank is, how each attempt ended.

:mod:`torchtrace.job.state` keeps each rank's black box, the small file that another rank,
the next attempt and ``torchtrace why`` read. :mod:`~torchtrace.job.progress` keeps in it what
the training thread is doing now; :mod:`~torchtrace.job.watchdog` notices when that stops
(docs/hangs.md), :mod:`~torchtrace.job.stacks` records where every thread is, and
:mod:`~torchtrace.job.culprit` judges the job from every rank's black box.
"""

from __future__ import annotations

from torchtrace.job.state import RankState, read_states

__all__ = ["RankState", "read_states"]
