"""``ddpwatch demo``: a real DDP job with scripted faults, and simulated GPU ranks."""
