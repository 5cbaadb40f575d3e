"""executor."""
