"""The bundle contract: names, the typed manifest, stage and weight-format descriptions. Standard library only."""
