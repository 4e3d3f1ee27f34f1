"""Data: the synthetic multi-task mixture, datasets, sampler and the planning data loader."""
