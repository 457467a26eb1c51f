"""Fast paths of the core model: grouped / expert-parallel MoE and the CPU expert kernels."""
