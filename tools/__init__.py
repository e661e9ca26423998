"""Repository tools run by the Makefile (not installed with mirrax)."""
