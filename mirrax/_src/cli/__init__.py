"""The `mirrax` command line: devices, train, launch."""
