"""The memory_analysis study (`study.py`, `schema.py`, `report.py`, `report.md`)."""
