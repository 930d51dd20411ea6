"""Reproducibility: one verdict over two fingerprints (``diff``) and the offline CI check (``check``)."""
