"""The train study (`study.py`, `schema.py`, `report.py`, `report.md`)."""
