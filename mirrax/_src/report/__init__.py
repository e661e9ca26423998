"""The scaling report (`mirrax.experimental.scaling_report`, `mirrax report`): what a step's
collectives, memory and time will be on N replicas, read from its compiled program."""
