"""Keras-style training on top of the distribute runtime: losses, metrics, Model."""
