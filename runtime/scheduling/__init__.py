"""The head's scheduling: one engine loop per chain of paged stages, its tick planner, block tables and requests."""
