"""mirrax internals. Nothing here is public API; import from `mirrax` instead."""
