"""Decoding over a chain of stages: the plain and speculative decode loops, drafters and accept rules."""
