"""Attention implementations: the float64 reference and every provider the studies compare."""
