"""Tools around the compiler: random checkpoints (synth) and the demo."""
