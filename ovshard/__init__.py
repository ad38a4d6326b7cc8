"""ovshard: compile a Hugging Face causal LM into pipeline stages of stateful OpenVINO IR.

Three parts share this import root: ``ovshard`` (compiler driver), ``ovshard.passes`` (the pass
library) and ``ovshard.runtime`` (what a node needs to run a stage). Importing this package imports
nothing heavy; torch, transformers and nncf are loaded only by the compile path.
"""

from __future__ import annotations

__version__ = "0.1.0"
