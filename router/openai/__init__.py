"""The router's OpenAI-compatible HTTP edge: the FastAPI app, its request and response models, streaming, errors and tool calls."""
