"""Triton kernels (G4-T1, G4-T2, G4-C1). Each file: reference, kernels, launchers, autograd, functional."""
