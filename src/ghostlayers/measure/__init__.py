"""What a model scores: perplexity, prefix states shared between models (prefix), zero-shot accuracy (zeroshot),
speed, one model's evaluation (evaluation), the report, and quieting other libraries (chatter)."""
