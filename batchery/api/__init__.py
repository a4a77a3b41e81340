"""``batchery serve``: OpenAI's HTTP API (Files, Batches, Chat Completions, Completions, Responses,
Models) backed by the queue, the job store and the workers. Needs ``pip install 'batchery[serve]'``
(FastAPI, uvicorn, python-multipart); imports nothing of the engine or the worker."""
