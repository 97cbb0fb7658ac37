"""The allocator study (`study.py`, `schema.py`, `report.py`, `report.md`)."""
