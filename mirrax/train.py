"""`mirrax.train`: the checkpoint names TF users find under `tf.train`.

    ckpt = mirrax.train.Checkpoint(model=model, optimizer=optimizer)
    ckpt.save(os.path.join(checkpoint_dir, "ckpt"))          # ckpt-1, ckpt-2, ...
    ckpt.restore(mirrax.train.latest_checkpoint(checkpoint_dir))
    for path in mirrax.train.checkpoints_iterator(checkpoint_dir, timeout=60): ...

`Checkpoint` and `CheckpointManager` are `mirrax.Checkpoint` and `mirrax.CheckpointManager`.
"""

from mirrax._src.checkpointing.checkpoint import Checkpoint as Checkpoint
from mirrax._src.checkpointing.manager import CheckpointManager as CheckpointManager
from mirrax._src.checkpointing.state_file import checkpoints_iterator as checkpoints_iterator
from mirrax._src.checkpointing.state_file import latest_checkpoint as latest_checkpoint

__all__ = ["Checkpoint", "CheckpointManager", "checkpoints_iterator", "latest_checkpoint"]
