"""Serving artifacts: `mirrax.export` writes a model's forward pass with `jax.export`, and
`mirrax.load_exported` runs it without the model's code.

artifact.py: the artifact's files and format version; signature.py: input signatures (the
symbolic batch dimension, how they are described); export.py: tracing, lowering and writing;
load.py: reading an artifact and `ExportedModel`, the callable it becomes.
"""
