"""The compiler's subcommands: compile, bundle merge, inspect, verify, cache, synth, demo."""
