"""The cpu_baseline study (`study.py`, `schema.py`, `report.py`, `report.md`)."""
