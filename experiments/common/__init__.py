"""What several studies share: the module providers (``modules.py``) and their schema, paired-ratio readings
for the reports (``paired.py``), a training run's schedule and loop (``schedule.py``, ``fit.py``)."""
