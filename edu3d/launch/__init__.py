"""Starting, watching and ending ranks: torchrun as a subprocess, watched from Python.

* :mod:`~edu3d.launch.api`: ``launch(target, n)``; :mod:`~edu3d.launch.agent`: torchrun's
  agent with loopback stores, recording how each rank ended;
* :mod:`~edu3d.launch.supervise`: the one loop that watches a run, cold or warm;
* :mod:`~edu3d.launch.worker`: what wraps your code on each rank;
* :mod:`~edu3d.launch.procs`: a run's processes, their ending, and the errors that name a rank;
* :mod:`~edu3d.launch.run_files`: a run folder's rules, every file's name, writer and reader
  (read as anyone's); :mod:`~edu3d.launch.runs`: run folders made, kept tidy, and what their
  ranks left read back; :mod:`~edu3d.launch.heartbeat`: a hung or stopped rank named;
  :mod:`~edu3d.launch.cores`: how many ranks the cores hold;
* :mod:`~edu3d.launch.magic`: ``%%torchrun``; :mod:`~edu3d.launch.status`: a notebook's status line;
* :mod:`edu3d.launch.warm`: warm rank pools for notebook launches.

Nothing here imports torch: ``edu3d run`` adds almost nothing to a bare torchrun.
"""

from edu3d.launch.api import (LaunchError, LaunchTimeout, RankError, RankHung, RunResult,
                              RunsError, launch)

__all__ = ["launch", "LaunchError", "LaunchTimeout", "RankError", "RankHung", "RunResult",
           "RunsError"]
