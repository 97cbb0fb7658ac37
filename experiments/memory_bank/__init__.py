"""The memory_bank study (`study.py`, `schema.py`, `report.py`, `report.md`)."""
