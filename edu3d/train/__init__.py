"""One Trainer (the step of every layout), the pre-flight, the loop behind ``edu3d train``.

Around the step, each in a room of its own: the data and the cut of a global batch, the
optimizer, faults, what a step records, the state a checkpoint places and the tensors a
chart gathers.
"""
