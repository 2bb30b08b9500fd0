"""Pipeline parallelism: the engine that runs a schedule over send/recv, and a rank's stages.

The schedules themselves are data (:mod:`edu3d.schedules`: partitioning, action lists, the
checker and the simulator); this package executes them: :mod:`~edu3d.parallel.pp.stage` cuts
the serial model into this rank's stages, :mod:`~edu3d.parallel.pp.engine` is the small
interpreter of the action lists.
"""
