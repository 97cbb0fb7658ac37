"""The attention_backends study (`study.py`, `schema.py`, `report.py`, `report.md`)."""
