"""One Trainer, the loop behind ``edu3d train``, its options, data, optimizer and faults."""
