"""The rank study (`study.py`, `schema.py`, `report.py`, `report.md`)."""
