"""ragfix: fix position bias in retrieval-augmented generation."""
