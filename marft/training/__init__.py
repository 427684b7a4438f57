"""The training loop (:mod:`.runner`: one iteration's named phases), checkpoints, preemption, storage and logs."""
