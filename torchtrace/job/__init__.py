"""The whole job, not only the step: where each rank is, how each attempt ended.

:mod:`torchtrace.job.state` keeps each rank's black box, the small file that another rank,
the next attempt and ``torchtrace why`` read. :mod:`~torchtrace.job.progress` keeps in it what
the training thread is doing now; :mod:`~torchtrace.job.watchdog` notices when that stops
(docs/hangs.md), :mod:`~torchtrace.job.stacks` records where every thread is, and
:mod:`~torchtrace.job.culprit` judges the job from every rank's black box.
:mod:`~torchtrace.job.identity` names the job and
its attempts and lays them out in the run directory; :mod:`~torchtrace.job.ending` (with
:mod:`~torchtrace.job.cgroup`) tells how an attempt ended, :mod:`~torchtrace.job.signals`
saves what a SIGTERM would lose; :mod:`~torchtrace.job.checkpoints` times saves and loads;
:func:`~torchtrace.job.story.job_story` tells the whole job and its goodput.
"""

from __future__ import annotations

from torchtrace.job.state import RankState, read_states
from torchtrace.job.story import job_story

__all__ = ["RankState", "job_story", "read_states"]
