"""Checking bundles: verify (runtime fusion, reference numbers), the static fusion predictor, inspect."""
