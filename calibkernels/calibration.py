"""Temperature scaling (SPEC §4)."""
