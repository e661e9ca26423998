"""Checkpoints on Orbax: `Checkpoint` and `CheckpointManager` (tf.train's names), and the
directories `Model.save_weights` writes.

checkpoint.py: `Checkpoint`, `save_weights` / `load_weights`; manager.py: `CheckpointManager`;
parts.py: what is stored of each tracked object; restore.py: reading a checkpoint into them and
the status a restore returns; directory.py: a checkpoint directory on disk; orbax_quiet.py:
Orbax's output that mirrax's own checks make redundant, silenced; state_file.py: TF's
`checkpoint` state file, `latest_checkpoint`, `checkpoints_iterator`; workers.py: multi-worker
saves to per-worker paths (TF's pattern) and state no step has touched.
"""
