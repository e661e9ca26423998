"""The parts every benchmark shares, defined once: `env` (command line, device counts, one
subprocess per count, versions and machine), `timing` (steps in flight, interleaved windows,
paired ratios, cProfile), `workers` (worker processes over stdin/stdout; pinned Gloo pairs),
`models` (the CNN, MLPs, transformer, ResNet-50 and the hand-written step mirrax is measured
against), `peer_models` (their Keras and PyTorch twins) and `hlo` (compiled train steps, their
collectives). Only `models` imports JAX at load: import it after
`env.configure_jax_environment` (the fake CPU device count is fixed when JAX starts)."""
