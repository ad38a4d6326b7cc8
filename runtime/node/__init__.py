"""The stage node: the TCP worker that serves one stage, its sessions, limits and per-step checks."""
