"""Tensor parallelism's lowest layer: the group of ranks and its collectives (group.py), imported by models/. What
each rank holds of the model is models/shard.py; the processes, step plans and worker loop are engine/tp_*.py."""
