"""GPU kernels and their CPU references: the fused log-prob head and AdamW. Triton is imported only
by the kernel modules themselves (CPU-only installs lack it)."""
