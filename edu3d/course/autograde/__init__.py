"""The grading engine behind ``edu3d grade``, below the command line so that a notebook or a
script grades without importing a command module.

Read in this order:

* :mod:`~edu3d.course.autograde.scoring`: the exercises, each notebook run and scored from
  the verdicts its checks reported (:func:`~edu3d.course.autograde.scoring.grade`);
* :mod:`~edu3d.course.autograde.kernel`: the fresh kernel a notebook runs in, watched for a
  timeout or its death;
* :mod:`~edu3d.course.autograde.channel`: the grader's end of the sealed verdict channel
  (the kernel's end is :mod:`edu3d.course.verdict_channel`);
* :mod:`~edu3d.course.autograde.hints`: how many times each check failed, kept between runs;
* :mod:`~edu3d.course.autograde.processes`: every process a submission started, killed
  when its grade ends;
* :mod:`~edu3d.course.autograde.isolate`: ``--isolate``'s Linux namespaces;
* :mod:`~edu3d.course.autograde.report`: the score table, and the report's own file.
"""
