"""The tf.distribute core on JAX: strategies, distributed values, replica context, input, losses."""
