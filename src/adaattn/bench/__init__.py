"""The one benchmark harness: timing, peak memory, accuracy, roofline units, results."""
