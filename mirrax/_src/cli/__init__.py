"""The `mirrax` command line: devices, train."""
