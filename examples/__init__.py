"""The example programs, installed with mirrax as the package `mirrax.examples`.

Each file is a standalone program a user can read and copy; run it as a script
(`python examples/keras_fit.py --epochs 1`) or as a module (`python -m
mirrax.examples.keras_fit`). `mirrax train` runs these same programs (`--loop fit` runs
`keras_fit`, `--loop custom` runs `custom_training_loop`), so the command and the examples
cannot drift apart.
"""
