"""The studies, one folder each: ``study.py`` (what it measures: ``STUDY``), ``schema.py`` (its params.yaml
sections), ``report.py`` (its tables, figures and verdicts) and ``report.md`` (its prose). The registry
(``adaattn_pipeline.registry``) finds them; ``common/`` is what several share. Studies never import each other."""
