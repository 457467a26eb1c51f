"""XLA:CPU-only machinery of the models: the C++ MoE expert kernels as XLA FFI custom calls
(`expert_kernel`, sources in `csrc/`) and per-executable CPU compile options (`compile_options`).
Which of it a model uses is decided once, when the model is built (`moe.select_strategy`)."""
