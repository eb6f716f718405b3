"""Model folders on disk: writing (saving), the model card (card), loading (loading) and GGUF export (gguf)."""
