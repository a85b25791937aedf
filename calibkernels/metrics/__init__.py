"""Calibration metrics (SPEC §3) — being written."""
