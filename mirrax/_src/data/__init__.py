"""Data sets: scikit-learn's bundled digits (embedded) and CIFAR-10 read from its own files."""
