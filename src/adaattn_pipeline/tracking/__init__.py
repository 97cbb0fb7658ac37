"""Experiment tracking: the results files, logged to MLflow."""
