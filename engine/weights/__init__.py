"""Weight formats: checkpoints (Hugging Face directories, GGUF files) -> ``ModelConfig`` + a state dict in the engine's fused layout, and the quantized blocks some formats keep."""
