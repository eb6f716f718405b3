"""The model in memory: architecture adapters, surgery, the remote-code module copied into saved folders
(modeling_ghostlayers), the pruning record (record) and the checkpoint read layer by layer (checkpoint)."""
