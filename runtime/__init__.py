"""The runtime: what a node needs to run a stage bundle, by role (wire, engine, node, client, serve, cluster); no compiler, no torch."""
