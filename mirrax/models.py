"""`mirrax.models`, as `tf.keras.models`: `load_model` reads what `mirrax.Model.save` writes."""

from mirrax._src.training.model_loading import load_model as load_model

__all__ = ["load_model"]
