"""Curation: embeddings computed once per sample, scores, filters and semantic deduplication."""
