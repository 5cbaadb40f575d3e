"""Presentation over the store and run records: tables, reports, figures, lineage. Never torch."""
