"""The graph layer: pass infrastructure, instruments, the deterministic printer, OpenVINO graph helpers."""
