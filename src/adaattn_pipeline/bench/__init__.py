"""The one benchmark harness: a study's cases run, timed (``adaattn.timing``), checked against a reference and
written as results; the runner that checks the target's hardware first."""
