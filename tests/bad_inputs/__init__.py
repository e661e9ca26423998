"""The catalogue of bad inputs: one module of cases per area of the public API.

Each module defines `CASES`, a list of `Case`; tests/test_bad_inputs.py runs every case (on every
named strategy where `each_strategy` is set) and checks the error's class and message.
"""
