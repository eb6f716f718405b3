"""What the tool can do, as tables: the recovery methods and their sums (methods), the selection criteria
(criteria). Torch-free."""
