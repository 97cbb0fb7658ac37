"""Reports: figures and markdown tables rendered only from the results files."""
