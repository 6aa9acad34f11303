"""What lands on disk: the output's columns (layout), the run manifest (claim, commit records, resume), readers of an output, the storage precision of embeddings and their Arrow form."""
