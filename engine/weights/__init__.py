"""Weight formats: checkpoints -> ``ModelConfig`` + a state dict in the engine's fused layout, and the quantized blocks
some formats keep.

- ``model_files.py``: model names -> config, weights and tokenizer (``load_model_files``);
- ``hf_checkpoint.py``: Hugging Face checkpoint directories, in and out;
- ``gguf_file.py``: llama.cpp GGUF files;
- ``parameter_layout.py``: every parameter's name, shape and the checkpoint tensors it is fused from;
- ``quantized_weights.py``: weights kept in quantized blocks, from the loader to the native kernels' panels.
"""
