"""The checkpointing study (`study.py`, `schema.py`, `report.py`, `report.md`)."""
