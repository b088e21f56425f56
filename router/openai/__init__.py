"""The router's OpenAI-compatible HTTP edge, in the order a request crosses it:

- ``app.py``: ``create_app(router)``, the FastAPI application and its endpoints;
- ``middleware.py``: API keys, the body size limit, request ids;
- ``fields.py``: ``StrictModel``, what a body may carry; ``requests.py`` and ``chat_requests.py``: the request
  bodies and how they become ``SamplingParams``;
- ``tool_calls.py``: tools into the prompt and a grammar, the model's output back into ``tool_calls``;
- ``format.py``: the router's outputs -> OpenAI responses and stream chunks; ``responses.py``: those JSON shapes;
- ``stream.py``: the ``text/event-stream`` answers;
- ``errors.py``: errors in OpenAI's JSON shape.
"""
