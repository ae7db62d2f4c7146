"""GPU kernels (Triton) with their torch references."""
