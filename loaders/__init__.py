"""Training-side readers of shardsmith releases: open_release (release.py), a torch IterableDataset (dataset.py), DALI pipelines (dali.py), multimodal packing (packing.py)."""
