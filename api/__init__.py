"""The OpenAI-compatible HTTP gateway (`tandem serve api`): /v1/models, /v1/completions and
/v1/chat/completions over the SDK's AsyncClient to the dispatcher (api/app.py)."""
