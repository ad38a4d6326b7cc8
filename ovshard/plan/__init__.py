"""Partition planner: cost model and the optimal cut of the layer chain into pipeline stages."""
